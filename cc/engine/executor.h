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
#include <memory>
#include <vector>

#include "cc/engine/device.h"
#include "cc/engine/engine.h"
#include "cc/engine/message.h"
#include "cc/engine/timeline.h"
#include "cc/transport/transport.h"

namespace mpistrategy {

// Payload bytes of a successful response (what fusion packs): the input
// size of the single named tensor on every rank for allreduce; 0 otherwise.
int64_t AllreduceBytes(const Response& response);

class Executor {
 public:
  // Args:
  //   transport: not owned; outlives the executor.
  //   hierarchical_allreduce: EngineConfig::hierarchical_allreduce (GPU
  //     tensors only).
  //   timeline: where the copy and collective spans of every bucket go
  //     (timeline.h); null disables them.  Not owned; outlives the executor.
  explicit Executor(Transport* transport, bool hierarchical_allreduce = false,
                    Timeline* timeline = nullptr);

  // Runs one bucket.  `responses` are the bucket's members (successful
  // responses; more than one only for fused allreduces) and `entries[k]` is
  // this rank's entry for responses[k]->names[0].  GPU buckets go to the
  // DeviceTransport (device.h), created by the first one.
  //
  // Returns the transport's error (fatal for the engine).  Per-entry local
  // failures go to (*entry_status)[k], resized to entries.size().  With a
  // timeline, records each entry's copy and collective spans.
  Status Execute(const std::vector<const Response*>& responses,
                 const std::vector<TensorEntry*>& entries,
                 std::vector<Status>* entry_status);

 private:
  // Execute without the collective span.
  Status Run(DeviceTransport* device,
             const std::vector<const Response*>& responses,
             const std::vector<TensorEntry*>& entries,
             std::vector<Status>* entry_status);
  // Records `activity` from `start` to `end` on the row of every entry, with
  // the bucket's size in the args.  Requires timeline_ != nullptr.
  void Trace(const char* activity,
             const std::vector<const Response*>& responses,
             const std::vector<TensorEntry*>& entries, double start,
             double end);
  Status Allreduce(const std::vector<const Response*>& responses,
                   const std::vector<TensorEntry*>& entries,
                   std::vector<Status>* entry_status);
  // A group packed by dtype segments (Response::packed_dtypes), in place.
  Status AllreduceMixedPack(const Response& response, TensorEntry* entry,
                            Status* entry_status);
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

  // The bucket's device collectives (GPU tensors), creating them on first
  // use; null for CPU buckets and barriers.
  Status DeviceTransportFor(const Response& response, const TensorEntry& entry,
                            DeviceTransport** device_transport);

  Transport* transport_;
  const bool hierarchical_allreduce_;
  Timeline* const timeline_;  // may be null
  std::unique_ptr<DeviceTransport> device_transport_;
  int rank_;
  int size_;
  std::vector<char> buffer_;
  // Reused per call to avoid per-cycle allocations.
  std::vector<int64_t> counts_;
  std::vector<int64_t> counts2_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_EXECUTOR_H_
