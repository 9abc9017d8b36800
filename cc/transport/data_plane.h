// The data plane: the payload collectives on raw buffers of one device.
//
// One interface for every way a bucket's payload can travel:
//   * HostPlane (host_plane.h): the engine's Transport (MPI) on host memory;
//   * StagingPlane (staging_plane.h): device buffers copied to the host, a
//     host Transport, copied back;
//   * NcclPlane (nccl_plane.h): NCCL on the device stream;
//   * HierarchicalPlane (hierarchical_plane.h): allreduce as a reduce-scatter
//     inside the host, a host allreduce across hosts and an allgather inside
//     the host; the other collectives on an all-ranks plane.
// The executor (cc/engine/executor.h) computes layouts and fusion once and
// calls the bucket's plane; a plane knows nothing of tensors or responses.
//
// Every method is called by all ranks of the plane in the same order, from
// one thread (the engine's), with buffers of `stream`'s device, and
// enqueues its work on `stream`: the work may still be running when the
// call returns (not on a host-synchronous stream).  A returned error means
// the ranks may be out of step: fatal for the engine.  Work that fails later
// reports through async_status().

#ifndef MPISTRATEGY_CC_TRANSPORT_DATA_PLANE_H_
#define MPISTRATEGY_CC_TRANSPORT_DATA_PLANE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cc/common/common.h"
#include "cc/common/stream.h"

namespace mpistrategy {

// One tensor of a fused allreduce handed to a plane unpacked: `count`
// elements read from `in` and written to `out` (`in == out`: in place).
struct AllreducePart {
  const void* in;
  void* out;
  int64_t count;
};

class DataPlane {
 public:
  virtual ~DataPlane() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // For log lines: "MPI", "NCCL", "MPI with host staging", ...
  virtual const char* name() const = 0;

  // out[i] = reduce over ranks of in[i]; `in == out` means in place.
  // kMean divides the sum by size() (floating dtypes only).
  virtual Status Allreduce(const void* in, void* out, int64_t count,
                           DataType dtype, ReduceOp op, Stream* stream) = 0;
  // True when Allreduce copies its data through memory of its own anyway
  // (shared memory): then the executor hands a fused bucket's tensors to
  // AllreduceParts as they are, because packing them into a fusion buffer
  // first would add a copy in and a copy out.  The same on every rank:
  // what the executor hands the plane depends on it.
  virtual bool reduces_parts() const { return false; }
  // As Allreduce on the parts laid end to end (one dtype).  Only called
  // when reduces_parts().
  virtual Status AllreduceParts(const std::vector<AllreducePart>& parts,
                                DataType dtype, ReduceOp op, Stream* stream) {
    return Status::Internal(std::string(name()) +
                            " data plane cannot reduce unpacked parts");
  }
  // For the timeline: how the last Allreduce or AllreduceParts handed its
  // data to the other ranks' cores, where the plane chooses that as it
  // runs ("cached" or "streaming" stores: handoff_tuner.h); null where the
  // plane has no such choice or that call did not make it.
  virtual const char* last_allreduce_handoff() const { return nullptr; }
  // Concatenates every rank's bytes in rank order into `out`;
  // bytes_per_rank[r] is rank r's contribution.
  virtual Status Allgatherv(const void* in, void* out,
                            const std::vector<int64_t>& bytes_per_rank,
                            Stream* stream) = 0;
  // In place: root_rank's `bytes` replace every other rank's.
  virtual Status Broadcast(void* buffer, int64_t bytes, int root_rank,
                           Stream* stream) = 0;
  // Reduces `in` (sum of counts elements) and leaves block r, of counts[r]
  // elements, on rank r in `out` (a valid pointer even when the block is
  // empty).  kMean divides by size().
  virtual Status Reducescatter(const void* in, void* out,
                               const std::vector<int64_t>& counts,
                               DataType dtype, ReduceOp op,
                               Stream* stream) = 0;
  // send_bytes[r] bytes go to rank r (consecutive in `in`); recv_bytes[r]
  // bytes come from rank r (consecutive in `out`).
  virtual Status Alltoallv(const void* in,
                           const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes,
                           Stream* stream) = 0;

  // What the work enqueued so far will report once it has run: sticky, set
  // by the plane when asynchronous work fails.  Null when the plane's work
  // cannot fail after its call returned.
  virtual std::shared_ptr<const AsyncStatus> async_status() const {
    return nullptr;
  }
};

// kMean travels as kSum over planes that divide afterwards.
inline ReduceOp SumForMean(ReduceOp op) {
  return op == ReduceOp::kMean ? ReduceOp::kSum : op;
}

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_DATA_PLANE_H_
