// The data plane on host memory: a Transport's collectives (MPI, or the
// in-process fake world), with kMean as a sum divided on the host.

#ifndef MPISTRATEGY_CC_TRANSPORT_HOST_PLANE_H_
#define MPISTRATEGY_CC_TRANSPORT_HOST_PLANE_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cc/transport/data_plane.h"
#include "cc/transport/transport.h"

namespace mpistrategy {

class HostPlane : public DataPlane {
 public:
  // Where every rank shares one host, Allreduce hands the transport pieces
  // of at most this many bytes.  Open MPI reduces a large buffer through
  // main memory; pieces that stay in the caches took 64 MB from about 1.0x
  // raw MPI to 0.35-0.64x on the development VM, and kMean divides each
  // piece while it is still cached.  Smaller pieces were faster still
  // without single-copy (CMA) but made 4 MB twice as slow with it
  // (bench/RESULTS.md section 19).
  static constexpr int64_t kOneHostPieceBytes = int64_t{1} << 20;

  // `transport`: not owned; outlives the plane.
  explicit HostPlane(Transport* transport) : transport_(transport) {}
  // Owns `transport` (e.g. an MPI sub-communicator).  kMean divides by
  // `mean_divisor`, or by size() when 0 (a cross-host plane of hierarchical
  // allreduce divides by the number of all ranks).
  explicit HostPlane(std::unique_ptr<Transport> transport,
                     int64_t mean_divisor = 0)
      : owned_(std::move(transport)),
        transport_(owned_.get()),
        mean_divisor_(mean_divisor) {}

  int rank() const override { return transport_->rank(); }
  int size() const override { return transport_->size(); }
  const char* name() const override { return "host"; }

  // Every method needs a host-synchronous stream (Internal error otherwise).
  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op, Stream* stream) override;
  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes_per_rank,
                    Stream* stream) override;
  Status Broadcast(void* buffer, int64_t bytes, int root_rank,
                   Stream* stream) override;
  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dtype,
                       ReduceOp op, Stream* stream) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes,
                   Stream* stream) override;

 private:
  // Not across hosts: there each piece would pay a network round trip.
  bool OnOneHost() const {
    return transport_->size() > 1 &&
           transport_->local_size() == transport_->size();
  }
  int64_t divisor() const {
    return mean_divisor_ > 0 ? mean_divisor_ : size();
  }

  std::unique_ptr<Transport> owned_;
  Transport* const transport_;
  const int64_t mean_divisor_ = 0;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_HOST_PLANE_H_
