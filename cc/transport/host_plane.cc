#include "cc/transport/host_plane.h"

#include <algorithm>

#include "cc/common/reduce_kernels.h"

namespace mpistrategy {

namespace {

Status NeedHost(const Stream* stream) {
  if (stream == nullptr || !stream->host_synchronous()) {
    return Status::Internal(
        "the host data plane was given buffers of a device stream");
  }
  return Status::Ok();
}

}  // namespace

Status HostPlane::Allreduce(const void* in, void* out, int64_t count,
                            DataType dtype, ReduceOp op, Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  // Every rank sees the same count and transport, so all split alike.
  const int64_t esize = DataTypeSize(dtype);
  const int64_t piece = OnOneHost() ? kOneHostPieceBytes / esize : count;
  int64_t done = 0;
  do {
    const int64_t n = std::min(piece, count - done);
    const char* src = static_cast<const char*>(in) + done * esize;
    char* dst = static_cast<char*>(out) + done * esize;
    MPISTRATEGY_RETURN_IF_ERROR(
        transport_->Allreduce(src, dst, n, dtype, SumForMean(op)));
    // The piece was just written: its division reads it from cache.
    if (op == ReduceOp::kMean) {
      MPISTRATEGY_RETURN_IF_ERROR(DivideInPlace(dtype, dst, n, divisor()));
    }
    done += n;
  } while (done < count);
  return Status::Ok();
}

Status HostPlane::Allgatherv(const void* in, void* out,
                             const std::vector<int64_t>& bytes_per_rank,
                             Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  return transport_->Allgatherv(in, out, bytes_per_rank);
}

Status HostPlane::Broadcast(void* buffer, int64_t bytes, int root_rank,
                            Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  return transport_->Broadcast(buffer, bytes, root_rank);
}

Status HostPlane::Reducescatter(const void* in, void* out,
                                const std::vector<int64_t>& counts,
                                DataType dtype, ReduceOp op, Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  MPISTRATEGY_RETURN_IF_ERROR(
      transport_->Reducescatter(in, out, counts, dtype, SumForMean(op)));
  if (op != ReduceOp::kMean) return Status::Ok();
  return DivideInPlace(dtype, out, counts[rank()], divisor());
}

Status HostPlane::Alltoallv(const void* in,
                            const std::vector<int64_t>& send_bytes, void* out,
                            const std::vector<int64_t>& recv_bytes,
                            Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  return transport_->Alltoallv(in, send_bytes, out, recv_bytes);
}

}  // namespace mpistrategy
