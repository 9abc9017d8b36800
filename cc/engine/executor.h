// Runs negotiated (and fusion-planned) collectives against a Transport.
//
// Called from the engine thread only.  Every rank calls Execute* for the same
// buckets in the same order, so the transport calls match across ranks even
// when a rank fails locally (e.g. its output allocation fails): such a rank
// still takes part, receiving into scratch space, and reports the failure
// through `entry_status` only.

#ifndef MPISTRATEGY_CC_ENGINE_EXECUTOR_H_
#define MPISTRATEGY_CC_ENGINE_EXECUTOR_H_

#include <cstdint>
#include <vector>

#include "cc/engine/engine.h"
#include "cc/engine/message.h"
#include "cc/transport/transport.h"

namespace mpistrategy {

// Payload bytes of a successful response (what fusion packs): the input
// size of the single named tensor on every rank for allreduce; 0 otherwise.
int64_t AllreduceBytes(const Response& response);

class Executor {
 public:
  // Args:
  //   transport: not owned; outlives the executor.
  explicit Executor(Transport* transport);

  // Runs one bucket.  `responses` are the bucket's members (successful
  // responses; more than one only for fused allreduces) and `entries[k]` is
  // this rank's entry for responses[k]->names[0].
  //
  // Returns the transport's error (fatal for the engine).  Per-entry local
  // failures go to (*entry_status)[k], resized to entries.size().
  Status Execute(const std::vector<const Response*>& responses,
                 const std::vector<TensorEntry*>& entries,
                 std::vector<Status>* entry_status);

 private:
  Status Allreduce(const std::vector<const Response*>& responses,
                   const std::vector<TensorEntry*>& entries,
                   std::vector<Status>* entry_status);
  Status Allgather(const Response& response, TensorEntry* entry,
                   Status* entry_status);
  Status Broadcast(const Response& response, TensorEntry* entry);
  Status Reducescatter(const Response& response, TensorEntry* entry,
                       Status* entry_status);
  Status Alltoall(const Response& response, TensorEntry* entry,
                  Status* entry_status);

  // The persistent fusion / scratch buffer, at least `bytes` long.  Grows
  // only, so steady-state cycles allocate nothing.
  char* Buffer(int64_t bytes);

  Transport* transport_;
  int rank_;
  int size_;
  std::vector<char> buffer_;
  // Reused per call to avoid per-cycle allocations.
  std::vector<int64_t> counts_;
  std::vector<int64_t> counts2_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_EXECUTOR_H_
