// The one place the kernels and the C ABI (c_api.cc) find this process's
// engine.
//
// A kernel takes a reference with Get() for the duration of Enqueue only; it
// never stores it in a done-callback (the last reference would then be dropped
// on the engine's own thread, whose destructor joins that thread).

#ifndef MPISTRATEGY_CC_KERNELS_ENGINE_HOLDER_H_
#define MPISTRATEGY_CC_KERNELS_ENGINE_HOLDER_H_

#include <functional>
#include <memory>
#include <mutex>

#include "cc/common/common.h"
#include "cc/engine/config.h"
#include "cc/engine/engine.h"
#include "cc/transport/transport.h"

namespace mpistrategy {

class EngineHolder {
 public:
  // Creates the transport when Init needs one.  Called with lifecycle_mu_
  // held, from the thread that calls Init.
  using TransportFactory =
      std::function<Status(std::unique_ptr<Transport>* transport)>;

  // The holder of this process.  Never destroyed: a kernel or an atexit
  // handler may still use it while static destructors run.
  static EngineHolder& Instance();

  // Thread-safe.  The current engine, or null when not initialized.
  std::shared_ptr<Engine> Get() const;

  // Thread-safe.  Creates the engine unless one runs already.  Initializing
  // again with an equal config is a no-op; with a different config it fails
  // with FailedPrecondition naming the differing fields.  An engine that
  // stopped on an error (Engine::stopped) is replaced, whatever the config:
  // like the first Init, that is collective.  `on_peer_timeout` goes to
  // Engine::Create.  In a process forked from the one that created the
  // engine it fails with ForkedChildError().
  Status Init(const EngineConfig& config, const TransportFactory& factory,
              PeerTimeoutHandler on_peer_timeout = nullptr);

  // Thread-safe.  OK, or FailedPrecondition when this process is a fork
  // child of the process that created the engine: the engine's thread and
  // MPI do not survive fork, so a collective there would wait forever.
  Status ForkedChildError() const;
  // Thread-safe.  True in such a fork child (also after its Shutdown).
  bool IsForkedChild() const;

  // Thread-safe.  Destroys the engine (pending entries fail with Aborted and
  // the other ranks are told) once no kernel holds a reference any more.
  // A no-op when not initialized.  In a fork child the engine is dropped
  // without being destroyed (its thread does not exist there, and its MPI
  // communicators belong to the parent).
  void Shutdown();

  // Thread-safe.  Tells every rank's engine to fail its pending and future
  // entries with Aborted carrying `reason`; see Engine::Abort.  A no-op when
  // not initialized.
  void Abort(const std::string& reason, double timeout_seconds);

 private:
  EngineHolder() = default;

  // Shutdown's work; lifecycle_mu_ held.
  void ShutdownLocked();

  // Serializes Init/Shutdown; never held by kernels.
  std::mutex lifecycle_mu_;
  // Guards engine_; held only to copy or swap the pointer.
  mutable std::mutex mu_;
  std::shared_ptr<Engine> engine_;
  // The process that created an engine (getpid() at the last successful
  // Init; kept after Shutdown), 0 before; guarded by mu_.
  int64_t owner_pid_ = 0;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_KERNELS_ENGINE_HOLDER_H_
