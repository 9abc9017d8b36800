// Runs negotiated (and fusion-planned) collectives on data planes.
//
// The executor computes every layout (fusion offsets, allgather and
// reducescatter blocks, alltoall splits) once, for every device, and hands
// raw buffers to the bucket's DataPlane (cc/transport/data_plane.h) on the
// bucket's Stream (cc/common/stream.h): for CPU tensors a HostPlane over the
// engine's transport on a HostStream; for GPU tensors the plane the
// device's first entry creates (device.h) on the op's stream.
//
// Called inside the engine's cycles only (one at a time; on the engine
// thread, or for small CPU allreduces on the enqueuing thread: engine.h).
// Every rank calls Execute* for the same buckets in the same order, so the
// transport calls match across ranks even when a rank fails locally (e.g.
// its output allocation fails): such a rank still takes part, receiving into
// scratch space, and reports the failure through `entry_status` only.

#ifndef MPISTRATEGY_CC_ENGINE_EXECUTOR_H_
#define MPISTRATEGY_CC_ENGINE_EXECUTOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "cc/common/stream.h"
#include "cc/engine/device.h"
#include "cc/engine/engine.h"
#include "cc/engine/message.h"
#include "cc/engine/timeline.h"
#include "cc/transport/data_plane.h"
#include "cc/transport/host_plane.h"
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

  // Where later buckets' spans go (null: nowhere).  By the owner of the
  // cycles only, between buckets (Engine::SetTimeline).
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }

  // Sets up the plane of CPU tensors (Transport::CreateHostPlane): every
  // rank, once, before the first Execute.  Without it, or when the
  // transport creates none, CPU tensors go through the transport.  An error
  // is fatal for the engine.
  Status SetUpHostPlane(HostDataPlane kind, int64_t shm_bytes);
  // The plane of CPU tensors' name ("host", "shared memory", ...).
  const char* host_plane_name() const {
    return devices_.at(kCpuDevice).plane->name();
  }
  // Whether the plane of CPU tensors reduces them where they are.
  bool cpu_plane_reduces_parts() const {
    return devices_.at(kCpuDevice).plane->reduces_parts();
  }

  // Runs one bucket.  `responses` are the bucket's members (successful
  // responses; more than one only for fused allreduces) and `entries[k]` is
  // this rank's entry for responses[k]->names[0].  A GPU bucket's work is
  // enqueued on its first entry's stream, which first waits for the other
  // entries' streams (and they for it afterwards); each GPU entry's
  // DeviceContext gets the plane's async_status.
  //
  // Returns the plane's error (fatal for the engine).  Per-entry local
  // failures go to (*entry_status)[k], resized to entries.size().  With a
  // timeline, records each entry's copy and collective spans.
  Status Execute(const std::vector<const Response*>& responses,
                 const std::vector<TensorEntry*>& entries,
                 std::vector<Status>* entry_status);

 private:
  // One device's plane and scratch space.
  struct Device {
    DataPlane* plane = nullptr;  // host_plane_ or `owned`
    std::unique_ptr<DataPlane> owned;
    // Fusion / scratch buffer; grows only, so steady-state cycles allocate
    // nothing.
    std::shared_ptr<void> buffer;
    int64_t capacity = 0;
    // GPU: the stream that last used `buffer`, and the event that joins
    // streams (reused: a wait captures the event's state when enqueued).
    std::shared_ptr<Stream> buffer_stream;
    std::unique_ptr<Event> event;
  };

  // What the bucket runs on.
  struct Bucket {
    Device* device = nullptr;
    Stream* stream = nullptr;
  };

  // The bucket's device, plane and stream; creates the plane on the
  // device's first bucket.
  Status BucketFor(const Response& response,
                   const std::vector<TensorEntry*>& entries, Bucket* bucket);
  // Execute without the collective span.
  Status Run(const Bucket& bucket,
             const std::vector<const Response*>& responses,
             const std::vector<TensorEntry*>& entries,
             std::vector<Status>* entry_status);
  // Makes `stream` wait for the bucket's other streams and the buffer's
  // last user; ForkStreams makes the other streams wait for `stream`.
  Status JoinStreams(Device* device, const std::shared_ptr<Stream>& stream,
                     const std::vector<TensorEntry*>& entries);
  Status ForkStreams(Device* device, const std::shared_ptr<Stream>& stream);
  // Records `activity` from `start` to `end` on the row of every entry, with
  // the bucket's size (and the collective's handoff_) in the args, and sets
  // traced_.  Requires timeline_ != nullptr.
  void Trace(const char* activity,
             const std::vector<const Response*>& responses,
             const std::vector<TensorEntry*>& entries, double start,
             double end);
  Status Allreduce(const Bucket& bucket,
                   const std::vector<const Response*>& responses,
                   const std::vector<TensorEntry*>& entries);
  // A group whose kernel left the packing to the engine
  // (TensorEntry::packed_inputs): copies its tensors into its output at
  // their packed offsets, zeroes the gaps, and makes it an in-place entry.
  void PackInputs(TensorEntry* entry);
  // Appends the parts of such a group to parts_ instead: each tensor from
  // where it is into its packed offset, or into its own output
  // (packed_outputs); the gaps are left alone.
  void AppendPackedParts(TensorEntry* entry);
  // A group packed by dtype segments (Response::packed_dtypes), in place.
  Status AllreduceMixedPack(const Bucket& bucket, const Response& response,
                            TensorEntry* entry);
  Status Allgather(const Bucket& bucket, const Response& response,
                   TensorEntry* entry, Status* entry_status);
  Status Broadcast(const Bucket& bucket, const Response& response,
                   TensorEntry* entry);
  Status Reducescatter(const Bucket& bucket, const Response& response,
                       TensorEntry* entry, Status* entry_status);
  Status Alltoall(const Bucket& bucket, const Response& response,
                  TensorEntry* entry, Status* entry_status);

  // The device's fusion / scratch buffer, at least `bytes` (> 0) long.
  Status Buffer(const Bucket& bucket, int64_t bytes, char** buffer);

  Transport* transport_;
  const bool hierarchical_allreduce_;
  Timeline* timeline_;  // may be null
  int rank_;
  int size_;
  HostPlane host_plane_;
  std::shared_ptr<Stream> host_stream_;
  std::map<int32_t, Device> devices_;  // by TensorEntry::device
  // Reused per call to avoid per-cycle allocations.
  std::vector<int64_t> counts_;
  std::vector<int64_t> counts2_;
  std::vector<std::shared_ptr<Stream>> streams_;
  std::vector<AllreducePart> parts_;
  // The plane's last_allreduce_handoff() after this Execute's allreduce
  // (null before it, or where the plane has none), for the timeline.
  const char* handoff_ = nullptr;
  // Whether this Execute's collective recorded its spans itself (a fused
  // host bucket's copies, a plane that reduces the parts where they are),
  // so that Execute records no second span for it.
  bool traced_ = false;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_EXECUTOR_H_
