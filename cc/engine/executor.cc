#include "cc/engine/executor.h"

#include <cstring>

#include "cc/common/reduce_kernels.h"

namespace mpistrategy {

namespace {

ReduceOp TransportOp(ReduceOp op) {
  return op == ReduceOp::kMean ? ReduceOp::kSum : op;
}

}  // namespace

Status AllocateOutput(TensorEntry* entry, const Shape& shape, void** data) {
  *data = nullptr;
  Status s = entry->allocate_output(shape, data);
  if (s.ok() && *data == nullptr &&
      NumElements(shape) * DataTypeSize(entry->dtype) > 0) {
    s = Status::Internal("allocate_output for \"" + entry->name +
                         "\" returned no buffer for shape " +
                         ShapeString(shape));
  }
  if (!s.ok()) *data = nullptr;
  return s;
}

int64_t AllreduceBytes(const Response& response) {
  if (response.type != ResponseType::kAllreduce || response.shapes.empty()) {
    return 0;
  }
  return NumElements(response.shapes[0]) * DataTypeSize(response.dtype);
}

Executor::Executor(Transport* transport, bool hierarchical_allreduce,
                   Timeline* timeline)
    : transport_(transport),
      hierarchical_allreduce_(hierarchical_allreduce),
      timeline_(timeline),
      rank_(transport->rank()),
      size_(transport->size()) {}

char* Executor::Buffer(int64_t bytes) {
  if (static_cast<int64_t>(buffer_.size()) < bytes) {
    buffer_.resize(static_cast<size_t>(bytes));
  }
  return buffer_.data();
}

Status Executor::Execute(const std::vector<const Response*>& responses,
                         const std::vector<TensorEntry*>& entries,
                         std::vector<Status>* entry_status) {
  entry_status->assign(entries.size(), Status::Ok());
  const Response& first = *responses[0];
  DeviceTransport* device = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(DeviceTransportFor(first, *entries[0], &device));
  if (timeline_ == nullptr) {
    return Run(device, responses, entries, entry_status);
  }
  // A fused CPU allreduce records its copies and its collective itself.
  const bool fused = device == nullptr && responses.size() > 1;
  const double start = timeline_->Now();
  Status s = Run(device, responses, entries, entry_status);
  if (!fused) {
    // GPU buckets: the time to enqueue the work on the op's stream.
    Trace(TimelineCollectiveName(ToCollectiveType(first.type)), responses,
          entries, start, timeline_->Now());
  }
  return s;
}

void Executor::Trace(const char* activity,
                     const std::vector<const Response*>& responses,
                     const std::vector<TensorEntry*>& entries, double start,
                     double end) {
  const Response& first = *responses[0];
  TimelineArgs args;
  args.Add("bucket_tensors", static_cast<int64_t>(responses.size()));
  if (first.type == ResponseType::kAllreduce) {
    int64_t bytes = 0;
    for (const Response* r : responses) bytes += AllreduceBytes(*r);
    args.Add("bucket_bytes", bytes);
    // A lone tensor is reduced in place when the op's output is its input
    // (TF forwarded the buffer); a fused bucket goes through the buffer.
    if (entries.size() == 1) {
      args.Add("in_place",
               static_cast<int64_t>(entries[0]->input == entries[0]->output));
    }
  }
  if (!first.packed_dtypes.empty()) {
    args.Add("dtype", "mixed");
  } else if (first.type != ResponseType::kBarrier) {
    args.Add("dtype", DataTypeName(first.dtype));
  }
  args.Add("device", DeviceString(first.device));
  const std::string json = args.Json();
  for (const TensorEntry* e : entries) {
    timeline_->Span(e->name, activity, start, end, json);
  }
}

Status Executor::Run(DeviceTransport* device,
                     const std::vector<const Response*>& responses,
                     const std::vector<TensorEntry*>& entries,
                     std::vector<Status>* entry_status) {
  const Response& first = *responses[0];
  if (device != nullptr) {
    return device->Execute(responses, entries, entry_status);
  }
  switch (first.type) {
    case ResponseType::kAllreduce:
      return Allreduce(responses, entries, entry_status);
    case ResponseType::kAllgather:
      return Allgather(first, entries[0], &(*entry_status)[0]);
    case ResponseType::kBroadcast:
      return Broadcast(first, entries[0]);
    case ResponseType::kReducescatter:
      return Reducescatter(first, entries[0], &(*entry_status)[0]);
    case ResponseType::kAlltoall:
      return Alltoall(first, entries[0], &(*entry_status)[0]);
    case ResponseType::kBarrier:
      return transport_->Barrier();
    case ResponseType::kError:
      break;
  }
  return Status::Internal("Executor::Execute given an error response");
}

Status Executor::DeviceTransportFor(const Response& response,
                                   const TensorEntry& entry,
                                   DeviceTransport** device_transport) {
  *device_transport = nullptr;
  if (response.device == kCpuDevice ||
      response.type == ResponseType::kBarrier) {
    return Status::Ok();
  }
  if (device_transport_ == nullptr) {
    if (entry.device_context == nullptr) {
      return Status::Internal("GPU collective \"" + entry.name +
                              "\" has no device context");
    }
    MPISTRATEGY_RETURN_IF_ERROR(entry.device_context->CreateTransport(
        transport_, hierarchical_allreduce_, &device_transport_));
  }
  *device_transport = device_transport_.get();
  return Status::Ok();
}

Status Executor::Allreduce(const std::vector<const Response*>& responses,
                           const std::vector<TensorEntry*>& entries,
                           std::vector<Status>* entry_status) {
  const Response& first = *responses[0];
  const DataType dtype = first.dtype;
  const ReduceOp op = TransportOp(first.reduce_op);
  const bool mean = first.reduce_op == ReduceOp::kMean;
  if (responses.size() == 1 && !first.packed_dtypes.empty()) {
    return AllreduceMixedPack(first, entries[0], &(*entry_status)[0]);
  }
  if (responses.size() == 1) {
    // The big-tensor path: straight from input to output, no copies.
    TensorEntry* e = entries[0];
    const int64_t count = NumElements(first.shapes[0]);
    if (count == 0) return Status::Ok();
    MPISTRATEGY_RETURN_IF_ERROR(
        transport_->Allreduce(e->input, e->output, count, dtype, op));
    if (mean) (*entry_status)[0] = DivideInPlace(dtype, e->output, count, size_);
    return Status::Ok();
  }
  const int64_t element_size = DataTypeSize(dtype);
  int64_t total = 0;
  for (const Response* r : responses) total += NumElements(r->shapes[0]);
  if (total == 0) {
    if (timeline_ != nullptr) {
      const double now = timeline_->Now();
      Trace(TimelineCollectiveName(CollectiveType::kAllreduce), responses,
            entries, now, now);
    }
    return Status::Ok();
  }
  // Timeline marks: before the copies in, the collective, the copies out.
  double t0 = 0.0;
  double t1 = 0.0;
  double t2 = 0.0;
  if (timeline_ != nullptr) t0 = timeline_->Now();
  char* buffer = Buffer(total * element_size);
  int64_t offset = 0;
  for (size_t k = 0; k < responses.size(); ++k) {
    const int64_t bytes = NumElements(responses[k]->shapes[0]) * element_size;
    if (bytes > 0) std::memcpy(buffer + offset, entries[k]->input, bytes);
    offset += bytes;
  }
  if (timeline_ != nullptr) t1 = timeline_->Now();
  MPISTRATEGY_RETURN_IF_ERROR(
      transport_->Allreduce(buffer, buffer, total, dtype, op));
  if (mean) {
    Status s = DivideInPlace(dtype, buffer, total, size_);
    if (!s.ok()) entry_status->assign(entries.size(), s);
  }
  if (timeline_ != nullptr) t2 = timeline_->Now();
  offset = 0;
  for (size_t k = 0; k < responses.size(); ++k) {
    const int64_t bytes = NumElements(responses[k]->shapes[0]) * element_size;
    if (bytes > 0) std::memcpy(entries[k]->output, buffer + offset, bytes);
    offset += bytes;
  }
  if (timeline_ != nullptr) {
    const double t3 = timeline_->Now();
    Trace(kTimelineMemcpyIn, responses, entries, t0, t1);
    Trace(TimelineCollectiveName(CollectiveType::kAllreduce), responses,
          entries, t1, t2);
    Trace(kTimelineMemcpyOut, responses, entries, t2, t3);
  }
  return Status::Ok();
}

Status Executor::AllreduceMixedPack(const Response& response,
                                    TensorEntry* entry, Status* entry_status) {
  // The kernel packed the group into one buffer that is both input and
  // output; each dtype's segment is one transport call.
  const ReduceOp op = TransportOp(response.reduce_op);
  char* buffer = static_cast<char*>(entry->output);
  if (entry->input != entry->output) {
    return Status::Internal("mixed-dtype group \"" + entry->name +
                            "\" is not packed in place");
  }
  const PackedLayout layout =
      PackedGroupLayout(response.packed_dtypes, response.packed_shapes);
  for (const PackedSegment& segment : layout.segments) {
    if (segment.elements == 0) continue;
    char* data = buffer + segment.byte_offset;
    MPISTRATEGY_RETURN_IF_ERROR(transport_->Allreduce(
        data, data, segment.elements, segment.dtype, op));
    if (response.reduce_op == ReduceOp::kMean && entry_status->ok()) {
      *entry_status =
          DivideInPlace(segment.dtype, data, segment.elements, size_);
    }
  }
  return Status::Ok();
}

Status Executor::Allgather(const Response& response, TensorEntry* entry,
                           Status* entry_status) {
  int64_t rows = 0;
  int64_t total_bytes = 0;
  AllgatherLayout(response, size_, &counts_, &rows, &total_bytes);
  void* out = nullptr;
  *entry_status =
      AllocateOutput(entry, WithFirstDim(response.shapes[0], rows), &out);
  if (total_bytes == 0) return Status::Ok();
  if (out == nullptr) out = Buffer(total_bytes);
  return transport_->Allgatherv(entry->input, out, counts_);
}

Status Executor::Broadcast(const Response& response, TensorEntry* entry) {
  const int64_t bytes =
      NumElements(response.shapes[0]) * DataTypeSize(response.dtype);
  if (bytes == 0) return Status::Ok();
  if (rank_ == response.root_rank && entry->input != entry->output) {
    std::memcpy(entry->output, entry->input, bytes);
  }
  return transport_->Broadcast(entry->output, bytes, response.root_rank);
}

Status Executor::Reducescatter(const Response& response, TensorEntry* entry,
                               Status* entry_status) {
  const Shape& shape = response.shapes[0];
  const int64_t row_elements = RowElements(shape);
  const int64_t base = shape[0] / size_;
  const int64_t extra = shape[0] % size_;
  counts_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    counts_[r] = (base + (r < extra ? 1 : 0)) * row_elements;
  }
  const int64_t my_rows = base + (rank_ < extra ? 1 : 0);
  void* out = nullptr;
  *entry_status = AllocateOutput(entry, WithFirstDim(shape, my_rows), &out);
  if (NumElements(shape) == 0) return Status::Ok();
  if (out == nullptr) {
    out = Buffer(counts_[rank_] * DataTypeSize(response.dtype));
  }
  MPISTRATEGY_RETURN_IF_ERROR(transport_->Reducescatter(
      entry->input, out, counts_, response.dtype,
      TransportOp(response.reduce_op)));
  if (response.reduce_op == ReduceOp::kMean && entry_status->ok()) {
    *entry_status =
        DivideInPlace(response.dtype, out, counts_[rank_], size_);
  }
  return Status::Ok();
}

Status Executor::Alltoall(const Response& response, TensorEntry* entry,
                          Status* entry_status) {
  const int64_t row_bytes =
      RowElements(response.shapes[0]) * DataTypeSize(response.dtype);
  counts_.resize(size_);   // send bytes
  counts2_.resize(size_);  // receive bytes
  std::vector<int64_t> received_rows(size_);
  int64_t my_rows = 0;
  int64_t all_bytes = 0;
  for (int j = 0; j < size_; ++j) {
    counts_[j] = response.splits[static_cast<size_t>(rank_) * size_ + j] *
                 row_bytes;
    received_rows[j] =
        response.splits[static_cast<size_t>(j) * size_ + rank_];
    counts2_[j] = received_rows[j] * row_bytes;
    my_rows += received_rows[j];
  }
  for (int64_t s : response.splits) all_bytes += s * row_bytes;
  void* out = nullptr;
  *entry_status =
      AllocateOutput(entry, WithFirstDim(response.shapes[0], my_rows), &out);
  if (all_bytes > 0) {
    if (out == nullptr) out = Buffer(my_rows * row_bytes);
    MPISTRATEGY_RETURN_IF_ERROR(
        transport_->Alltoallv(entry->input, counts_, out, counts2_));
  }
  if (entry_status->ok() && entry->set_received_splits) {
    entry->set_received_splits(received_rows);
  }
  return Status::Ok();
}

}  // namespace mpistrategy
