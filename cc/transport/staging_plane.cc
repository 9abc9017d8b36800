#include "cc/transport/staging_plane.h"

#include <utility>

#include "cc/common/reduce_kernels.h"

namespace mpistrategy {

StagingPlane::StagingPlane(std::unique_ptr<DataPlane> host,
                           int64_t mean_divisor)
    : host_(std::move(host)),
      mean_divisor_(mean_divisor > 0 ? mean_divisor : host_->size()) {}

Status StagingPlane::HostBuffer(int64_t bytes, char** buffer) {
  // A copy enqueued by the previous collective may still read the buffer
  // (cudaMemcpyAsync from pageable memory may return before it has).
  if (copy_pending_) {
    copy_pending_ = false;
    MPISTRATEGY_RETURN_IF_ERROR(copied_->Synchronize());
  }
  if (static_cast<int64_t>(buffer_.size()) < bytes) {
    buffer_.resize(static_cast<size_t>(bytes));
  }
  *buffer = buffer_.data();
  return Status::Ok();
}

Status StagingPlane::CopyBack(void* dst, const char* src, int64_t bytes,
                              Stream* stream) {
  if (bytes == 0) return Status::Ok();
  MPISTRATEGY_RETURN_IF_ERROR(
      stream->Memcpy(dst, src, bytes, CopyKind::kHostToDevice));
  if (copied_ == nullptr) MPISTRATEGY_RETURN_IF_ERROR(stream->NewEvent(&copied_));
  MPISTRATEGY_RETURN_IF_ERROR(stream->Record(copied_.get()));
  copy_pending_ = true;
  return Status::Ok();
}

Status StagingPlane::DivideMean(DataType dtype, void* data,
                                int64_t count) const {
  return DivideInPlace(dtype, data, count, mean_divisor_);
}

Status StagingPlane::Allreduce(const void* in, void* out, int64_t count,
                               DataType dtype, ReduceOp op, Stream* stream) {
  const int64_t bytes = count * DataTypeSize(dtype);
  if (bytes == 0) return Status::Ok();
  char* host = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(bytes, &host));
  MPISTRATEGY_RETURN_IF_ERROR(
      stream->Memcpy(host, in, bytes, CopyKind::kDeviceToHost));
  MPISTRATEGY_RETURN_IF_ERROR(stream->Synchronize());
  MPISTRATEGY_RETURN_IF_ERROR(host_->Allreduce(host, host, count, dtype,
                                               SumForMean(op), &host_stream_));
  if (op == ReduceOp::kMean) {
    MPISTRATEGY_RETURN_IF_ERROR(DivideMean(dtype, host, count));
  }
  return CopyBack(out, host, bytes, stream);
}

Status StagingPlane::Allgatherv(const void* in, void* out,
                                const std::vector<int64_t>& bytes_per_rank,
                                Stream* stream) {
  int64_t total = 0;
  for (int64_t b : bytes_per_rank) total += b;
  if (total == 0) return Status::Ok();
  const int64_t mine = bytes_per_rank[rank()];
  // [gathered | mine]
  char* host = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(total + mine, &host));
  if (mine > 0) {
    MPISTRATEGY_RETURN_IF_ERROR(
        stream->Memcpy(host + total, in, mine, CopyKind::kDeviceToHost));
    MPISTRATEGY_RETURN_IF_ERROR(stream->Synchronize());
  }
  MPISTRATEGY_RETURN_IF_ERROR(
      host_->Allgatherv(host + total, host, bytes_per_rank, &host_stream_));
  return CopyBack(out, host, total, stream);
}

Status StagingPlane::Broadcast(void* buffer, int64_t bytes, int root_rank,
                               Stream* stream) {
  if (bytes == 0) return Status::Ok();
  const bool root = rank() == root_rank;
  char* host = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(bytes, &host));
  if (root) {
    MPISTRATEGY_RETURN_IF_ERROR(
        stream->Memcpy(host, buffer, bytes, CopyKind::kDeviceToHost));
    MPISTRATEGY_RETURN_IF_ERROR(stream->Synchronize());
  }
  MPISTRATEGY_RETURN_IF_ERROR(
      host_->Broadcast(host, bytes, root_rank, &host_stream_));
  // The root's device buffer already holds the value.
  return root ? Status::Ok() : CopyBack(buffer, host, bytes, stream);
}

Status StagingPlane::Reducescatter(const void* in, void* out,
                                   const std::vector<int64_t>& counts,
                                   DataType dtype, ReduceOp op,
                                   Stream* stream) {
  const int64_t element_size = DataTypeSize(dtype);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  if (total == 0) return Status::Ok();
  const int64_t in_bytes = total * element_size;
  const int64_t mine = counts[rank()];
  // [input | my block]
  char* host = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(
      HostBuffer(in_bytes + mine * element_size, &host));
  MPISTRATEGY_RETURN_IF_ERROR(
      stream->Memcpy(host, in, in_bytes, CopyKind::kDeviceToHost));
  MPISTRATEGY_RETURN_IF_ERROR(stream->Synchronize());
  MPISTRATEGY_RETURN_IF_ERROR(host_->Reducescatter(
      host, host + in_bytes, counts, dtype, SumForMean(op), &host_stream_));
  if (op == ReduceOp::kMean) {
    MPISTRATEGY_RETURN_IF_ERROR(DivideMean(dtype, host + in_bytes, mine));
  }
  return CopyBack(out, host + in_bytes, mine * element_size, stream);
}

Status StagingPlane::Alltoallv(const void* in,
                               const std::vector<int64_t>& send_bytes,
                               void* out,
                               const std::vector<int64_t>& recv_bytes,
                               Stream* stream) {
  int64_t send_total = 0;
  int64_t recv_total = 0;
  for (int64_t b : send_bytes) send_total += b;
  for (int64_t b : recv_bytes) recv_total += b;
  // [send | receive]
  char* host = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(send_total + recv_total, &host));
  if (send_total > 0) {
    MPISTRATEGY_RETURN_IF_ERROR(
        stream->Memcpy(host, in, send_total, CopyKind::kDeviceToHost));
    MPISTRATEGY_RETURN_IF_ERROR(stream->Synchronize());
  }
  MPISTRATEGY_RETURN_IF_ERROR(host_->Alltoallv(
      host, send_bytes, host + send_total, recv_bytes, &host_stream_));
  return CopyBack(out, host + send_total, recv_total, stream);
}

}  // namespace mpistrategy
