// A device data plane through host memory: each collective copies its input
// from the device to a host buffer on the stream, waits for the stream, runs
// the collective on a host plane (MPI), and copies the result back on the
// stream.  The GPU fallback when NCCL cannot be used (ranks sharing a GPU,
// no usable NCCL), and the cross-host step of HierarchicalPlane.
//
// The copy back is not waited for: the host buffer stays untouched until
// the next collective, which first waits for it (an event recorded after
// the copy).

#ifndef MPISTRATEGY_CC_TRANSPORT_STAGING_PLANE_H_
#define MPISTRATEGY_CC_TRANSPORT_STAGING_PLANE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "cc/common/stream.h"
#include "cc/transport/data_plane.h"

namespace mpistrategy {

class StagingPlane : public DataPlane {
 public:
  // Args:
  //   host: the plane on host memory (usually a HostPlane).
  //   mean_divisor: what kMean divides the sum by; host->size() when <= 0.
  //     HierarchicalPlane passes the number of all ranks, as its cross-host
  //     step sums partial sums.
  explicit StagingPlane(std::unique_ptr<DataPlane> host,
                        int64_t mean_divisor = 0);

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  const char* name() const override { return "MPI with host staging"; }

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
  // The host buffer, at least `bytes` long, once no copy from it is pending.
  Status HostBuffer(int64_t bytes, char** buffer);
  // Copies `bytes` from the host buffer to `dst` on `stream`; the next
  // HostBuffer waits for it.
  Status CopyBack(void* dst, const char* src, int64_t bytes, Stream* stream);
  Status DivideMean(DataType dtype, void* data, int64_t count) const;

  std::unique_ptr<DataPlane> host_;
  const int64_t mean_divisor_;
  HostStream host_stream_;
  std::vector<char> buffer_;
  // Recorded after the last copy from buffer_ (created on first use, on the
  // first stream's device).
  std::unique_ptr<Event> copied_;
  bool copy_pending_ = false;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_STAGING_PLANE_H_
