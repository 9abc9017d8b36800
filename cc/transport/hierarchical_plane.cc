#include "cc/transport/hierarchical_plane.h"

#include <utility>

namespace mpistrategy {

HierarchicalPlane::HierarchicalPlane(std::unique_ptr<DataPlane> world,
                                     std::unique_ptr<DataPlane> local,
                                     std::unique_ptr<DataPlane> cross,
                                     CrossHost cross_host)
    : world_(std::move(world)),
      local_(std::move(local)),
      cross_(std::move(cross)),
      cross_host_(cross_host) {}

Status HierarchicalPlane::AllreduceFromFirstRanks(const void* in, void* out,
                                                  int64_t count,
                                                  DataType dtype, ReduceOp op,
                                                  Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(
      local_->Allreduce(in, out, count, dtype, SumForMean(op), stream));
  if (local_->rank() == 0) {
    MPISTRATEGY_RETURN_IF_ERROR(
        cross_->Allreduce(out, out, count, dtype, op, stream));
  }
  return local_->Broadcast(out, count * DataTypeSize(dtype), 0, stream);
}

Status HierarchicalPlane::Allreduce(const void* in, void* out, int64_t count,
                                    DataType dtype, ReduceOp op,
                                    Stream* stream) {
  if (count == 0) return Status::Ok();
  if (cross_host_ == CrossHost::kFirstRanks) {
    return AllreduceFromFirstRanks(in, out, count, dtype, op, stream);
  }
  const int local_size = local_->size();
  const int64_t element_size = DataTypeSize(dtype);
  const int64_t shard = (count + local_size - 1) / local_size;
  const int64_t shard_bytes = shard * element_size;
  const int64_t bytes = count * element_size;
  // Work in `out` when it holds every shard; else in the padded scratch.
  char* buffer = static_cast<char*>(out);
  if (shard * local_size != count) {
    const int64_t padded = shard_bytes * local_size;
    if (padded > scratch_bytes_) {
      scratch_.reset();
      scratch_bytes_ = 0;
      MPISTRATEGY_RETURN_IF_ERROR(stream->Allocate(padded, &scratch_));
      scratch_bytes_ = padded;
    }
    buffer = static_cast<char*>(scratch_.get());
  }
  if (buffer != in) {
    MPISTRATEGY_RETURN_IF_ERROR(
        stream->Memcpy(buffer, in, bytes, CopyKind::kDeviceToDevice));
  }
  char* mine = buffer + local_->rank() * shard_bytes;
  counts_.assign(local_size, shard);
  MPISTRATEGY_RETURN_IF_ERROR(local_->Reducescatter(
      buffer, mine, counts_, dtype, SumForMean(op), stream));
  MPISTRATEGY_RETURN_IF_ERROR(
      cross_->Allreduce(mine, mine, shard, dtype, op, stream));
  counts_.assign(local_size, shard_bytes);
  MPISTRATEGY_RETURN_IF_ERROR(local_->Allgatherv(mine, buffer, counts_, stream));
  if (buffer != out) {
    MPISTRATEGY_RETURN_IF_ERROR(
        stream->Memcpy(out, buffer, bytes, CopyKind::kDeviceToDevice));
  }
  return Status::Ok();
}

}  // namespace mpistrategy
