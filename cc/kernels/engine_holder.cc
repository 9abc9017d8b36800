#include "cc/kernels/engine_holder.h"

#include <unistd.h>

#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

namespace mpistrategy {
namespace {

// "cycle_time_ms (running: 1, requested: 5)" for every field that differs;
// empty when the configs are equal.
std::string ConfigDifferences(const EngineConfig& running,
                              const EngineConfig& requested) {
  std::ostringstream out;
  auto field = [&out](const char* name, const auto& a, const auto& b) {
    if (a == b) return;
    if (out.tellp() > 0) out << ", ";
    out << name << " (running: " << a << ", requested: " << b << ")";
  };
  field("fusion_threshold_bytes", running.fusion_threshold_bytes,
        requested.fusion_threshold_bytes);
  field("cycle_time_ms", running.cycle_time_ms, requested.cycle_time_ms);
  field("fusion_wait_ms", running.fusion_wait_ms, requested.fusion_wait_ms);
  field("autotune", running.autotune, requested.autotune);
  field("autotune_log", "'" + running.autotune_log + "'",
        "'" + requested.autotune_log + "'");
  field("cache_capacity", running.cache_capacity, requested.cache_capacity);
  field("stall_warning_seconds", running.stall_warning_seconds,
        requested.stall_warning_seconds);
  field("stall_timeout_seconds", running.stall_timeout_seconds,
        requested.stall_timeout_seconds);
  field("peer_timeout_seconds", running.peer_timeout_seconds,
        requested.peer_timeout_seconds);
  field("timeline", "'" + running.timeline_path + "'",
        "'" + requested.timeline_path + "'");
  field("hierarchical_allreduce", running.hierarchical_allreduce,
        requested.hierarchical_allreduce);
  field("data_plane", std::string(HostDataPlaneName(running.data_plane)),
        std::string(HostDataPlaneName(requested.data_plane)));
  field("shm_bytes", running.shm_bytes, requested.shm_bytes);
  return out.str();
}

}  // namespace

EngineHolder& EngineHolder::Instance() {
  // Leaked on purpose; see the header.
  static EngineHolder* holder = new EngineHolder();
  return *holder;
}

std::shared_ptr<Engine> EngineHolder::Get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_;
}

bool EngineHolder::IsForkedChild() const {
  std::lock_guard<std::mutex> lock(mu_);
  return owner_pid_ != 0 && owner_pid_ != static_cast<int64_t>(getpid());
}

Status EngineHolder::ForkedChildError() const {
  std::shared_ptr<Engine> engine;
  int64_t owner = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (owner_pid_ == 0 || owner_pid_ == static_cast<int64_t>(getpid())) {
      return Status::Ok();
    }
    engine = engine_;
    owner = owner_pid_;
  }
  const std::string parent =
      engine != nullptr ? engine->DescribeRank(engine->rank())
                        : "an MPI rank";
  return Status::FailedPrecondition(
      "mpistrategy cannot be used in process " +
      std::to_string(static_cast<int64_t>(getpid())) +
      ", which was forked (os.fork, or multiprocessing's 'fork' start "
      "method) from " + parent +
      " after mpistrategy was initialized there (pid " +
      std::to_string(owner) +
      "): MPI and mpistrategy's engine thread do not survive fork, so a "
      "collective here would wait forever. Run collectives in the MPI rank "
      "itself; worker processes must not call them (start them with the "
      "'spawn' or 'forkserver' method if they need TensorFlow)");
}

Status EngineHolder::Init(const EngineConfig& config,
                          const TransportFactory& factory,
                          PeerTimeoutHandler on_peer_timeout) {
  std::lock_guard<std::mutex> lifecycle(lifecycle_mu_);
  MPISTRATEGY_RETURN_IF_ERROR(ForkedChildError());
  if (std::shared_ptr<Engine> running = Get(); running && running->stopped()) {
    running.reset();
    ShutdownLocked();
  }
  if (std::shared_ptr<Engine> running = Get()) {
    const std::string diff = ConfigDifferences(running->config(), config);
    if (diff.empty()) return Status::Ok();
    return Status::FailedPrecondition(
        "mpistrategy is already initialized with a different configuration: " +
        diff + "; call mpistrategy.shutdown() first");
  }
  MPISTRATEGY_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<Transport> transport;
  MPISTRATEGY_RETURN_IF_ERROR(factory(&transport));
  std::unique_ptr<Engine> engine;
  MPISTRATEGY_RETURN_IF_ERROR(Engine::Create(
      config, std::move(transport), &engine, std::move(on_peer_timeout)));
  const Engine* started = engine.get();
  {
    std::lock_guard<std::mutex> lock(mu_);
    engine_ = std::move(engine);
    owner_pid_ = static_cast<int64_t>(getpid());
  }
  // A start that failed on any rank (a shared-memory segment that does not
  // fit) fails init on every rank.  The engine stays held, stopped: its
  // collectives fail with the same error until the next Init replaces it.
  return started->WaitUntilStarted();
}

void EngineHolder::Shutdown() {
  std::lock_guard<std::mutex> lifecycle(lifecycle_mu_);
  ShutdownLocked();
}

void EngineHolder::ShutdownLocked() {
  std::shared_ptr<Engine> engine;
  bool forked = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    forked = owner_pid_ != static_cast<int64_t>(getpid());
    engine.swap(engine_);
  }
  if (engine == nullptr) return;
  if (forked) {
    // Destroying it would join a thread that does not exist here and free
    // the parent's communicators: leak this copy instead.
    new std::shared_ptr<Engine>(std::move(engine));
    return;
  }
  // Kernels hold a reference only while they call Enqueue, so this wait is
  // short.  Waiting here (instead of letting the last kernel destroy the
  // engine) guarantees the engine, its thread and its communicator are gone
  // when Shutdown returns, so a following Init never overlaps with them.
  while (engine.use_count() > 1) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  engine.reset();
}

void EngineHolder::Abort(const std::string& reason, double timeout_seconds) {
  if (IsForkedChild()) return;
  if (std::shared_ptr<Engine> engine = Get()) {
    engine->Abort(reason, timeout_seconds);
  }
}

}  // namespace mpistrategy
