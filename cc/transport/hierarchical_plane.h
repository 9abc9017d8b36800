// Hierarchical allreduce: a plane among the ranks of a host (shared memory,
// NCCL), a cross-host plane among the ranks with the same local rank (MPI,
// on the host or through host staging), and an all-ranks plane for
// everything else.  Two ways for a host's sum to cross the hosts:
//
// CrossHost::kShards (every host runs the same number of ranks): an
// allreduce of `count` elements, padded to `local_size` equal shards,
//   1. reduce-scatter inside the host: local rank i holds the host's sum of
//      shard i (in place in the padded buffer);
//   2. allreduce of shard i across hosts, every local rank at once;
//   3. allgather of the shards inside the host.
// The padding is reduced too and then ignored.
//
// CrossHost::kFirstRanks (hosts may run different numbers of ranks):
//   1. allreduce inside the host;
//   2. local rank 0 of every host allreduces the host's sum across hosts;
//   3. broadcast from local rank 0 inside the host.
// Only local rank 0 calls its cross plane.
//
// In both, kMean sums inside the host and divides by the number of all
// ranks across hosts (the cross plane is built with that divisor).

#ifndef MPISTRATEGY_CC_TRANSPORT_HIERARCHICAL_PLANE_H_
#define MPISTRATEGY_CC_TRANSPORT_HIERARCHICAL_PLANE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "cc/transport/data_plane.h"

namespace mpistrategy {

class HierarchicalPlane : public DataPlane {
 public:
  enum class CrossHost { kShards, kFirstRanks };

  // Args:
  //   world: all ranks (rank and size are its); every collective but
  //     allreduce runs on it.
  //   local: the ranks of this host, in the order of their world ranks.
  //   cross: the ranks with this rank's local rank, one per host with that
  //     local rank, on device buffers; its kMean must divide by
  //     world->size().  Unused (may be null) on local ranks > 0 with
  //     kFirstRanks.
  //   cross_host: kShards needs the same number of ranks on every host.
  HierarchicalPlane(std::unique_ptr<DataPlane> world,
                    std::unique_ptr<DataPlane> local,
                    std::unique_ptr<DataPlane> cross,
                    CrossHost cross_host = CrossHost::kShards);

  int rank() const override { return world_->rank(); }
  int size() const override { return world_->size(); }
  const char* name() const override { return "hierarchical"; }

  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op, Stream* stream) override;
  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes_per_rank,
                    Stream* stream) override {
    return world_->Allgatherv(in, out, bytes_per_rank, stream);
  }
  Status Broadcast(void* buffer, int64_t bytes, int root_rank,
                   Stream* stream) override {
    return world_->Broadcast(buffer, bytes, root_rank, stream);
  }
  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dtype,
                       ReduceOp op, Stream* stream) override {
    return world_->Reducescatter(in, out, counts, dtype, op, stream);
  }
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes,
                   Stream* stream) override {
    return world_->Alltoallv(in, send_bytes, out, recv_bytes, stream);
  }
  std::shared_ptr<const AsyncStatus> async_status() const override {
    return world_->async_status();
  }

 private:
  Status AllreduceFromFirstRanks(const void* in, void* out, int64_t count,
                                 DataType dtype, ReduceOp op, Stream* stream);

  std::unique_ptr<DataPlane> world_;
  std::unique_ptr<DataPlane> local_;
  std::unique_ptr<DataPlane> cross_;
  const CrossHost cross_host_;
  // The padded buffer when the output cannot hold the padding; grows only.
  std::shared_ptr<void> scratch_;
  int64_t scratch_bytes_ = 0;
  std::vector<int64_t> counts_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_HIERARCHICAL_PLANE_H_
