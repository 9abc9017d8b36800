#include "cc/engine/executor.h"

#include <algorithm>
#include <cstring>

#include "cc/common/reduce_kernels.h"

namespace mpistrategy {

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

namespace {

// Device buffers grow in steps of this many bytes.
constexpr int64_t kBufferGranularity = int64_t{1} << 20;

// Calls gap(byte offset, bytes) for every stretch of `e`'s packed buffer
// between its group's tensors (and after the last), and
// member(i, byte offset, bytes) for tensor i, in buffer order; `e` has
// packed_inputs, so its group has one dtype and the tensors lie in order.
template <typename GapFn, typename MemberFn>
void ForEachPackedPiece(const TensorEntry& e, GapFn gap, MemberFn member) {
  const std::vector<DataType> dtypes(e.packed_shapes.size(), e.dtype);
  const PackedLayout layout = PackedGroupLayout(dtypes, e.packed_shapes);
  const int64_t esize = DataTypeSize(e.dtype);
  int64_t at = 0;
  for (size_t i = 0; i < e.packed_shapes.size(); ++i) {
    const int64_t offset = layout.byte_offsets[i];
    const int64_t bytes = NumElements(e.packed_shapes[i]) * esize;
    if (offset > at) gap(at, offset - at);
    if (bytes > 0) member(static_cast<int>(i), offset, bytes);
    at = std::max(at, offset + bytes);
  }
  const int64_t total = NumElements(e.shape) * esize;
  if (total > at) gap(at, total - at);
}

}  // namespace

Executor::Executor(Transport* transport, bool hierarchical_allreduce,
                   Timeline* timeline)
    : transport_(transport),
      hierarchical_allreduce_(hierarchical_allreduce),
      timeline_(timeline),
      rank_(transport->rank()),
      size_(transport->size()),
      host_plane_(transport),
      host_stream_(std::make_shared<HostStream>()) {
  devices_[kCpuDevice].plane = &host_plane_;
}

Status Executor::SetUpHostPlane(HostDataPlane kind, int64_t shm_bytes) {
  Device& cpu = devices_[kCpuDevice];
  MPISTRATEGY_RETURN_IF_ERROR(
      transport_->CreateHostPlane(kind, shm_bytes, &host_plane_, &cpu.owned));
  cpu.plane = cpu.owned != nullptr ? cpu.owned.get() : &host_plane_;
  return Status::Ok();
}

Status Executor::Buffer(const Bucket& bucket, int64_t bytes, char** buffer) {
  Device* d = bucket.device;
  if (bytes > d->capacity) {
    // Freed first so the allocator can reuse the space.
    d->buffer.reset();
    d->capacity = 0;
    const int64_t want = (bytes + kBufferGranularity - 1) /
                         kBufferGranularity * kBufferGranularity;
    MPISTRATEGY_RETURN_IF_ERROR(bucket.stream->Allocate(want, &d->buffer));
    d->capacity = want;
  }
  *buffer = static_cast<char*>(d->buffer.get());
  return Status::Ok();
}

Status Executor::BucketFor(const Response& response,
                           const std::vector<TensorEntry*>& entries,
                           Bucket* bucket) {
  if (response.device == kCpuDevice ||
      response.type == ResponseType::kBarrier) {
    bucket->device = &devices_[kCpuDevice];
    bucket->stream = host_stream_.get();
    return Status::Ok();
  }
  for (const TensorEntry* e : entries) {
    if (e->device_context == nullptr || e->device_context->stream() == nullptr) {
      return Status::Internal("GPU collective \"" + e->name +
                              "\" has no device context");
    }
  }
  const DeviceContext& context = *entries[0]->device_context;
  Device* d = &devices_[response.device];
  if (d->plane == nullptr) {
    MPISTRATEGY_RETURN_IF_ERROR(context.CreatePlane(
        transport_, hierarchical_allreduce_, response.device, &d->owned));
    d->plane = d->owned.get();
  }
  // A plane whose asynchronous work failed fails every later collective
  // of the device.
  if (auto status = d->plane->async_status()) {
    MPISTRATEGY_RETURN_IF_ERROR(status->Get());
  }
  bucket->device = d;
  bucket->stream = context.stream().get();
  return Status::Ok();
}

Status Executor::JoinStreams(Device* device,
                             const std::shared_ptr<Stream>& stream,
                             const std::vector<TensorEntry*>& entries) {
  streams_.clear();
  auto add = [this, &stream](const std::shared_ptr<Stream>& s) {
    if (s == nullptr || s->id() == stream->id()) return;
    for (const std::shared_ptr<Stream>& t : streams_) {
      if (t->id() == s->id()) return;
    }
    streams_.push_back(s);
  };
  for (const TensorEntry* e : entries) add(e->device_context->stream());
  add(device->buffer_stream);
  if (streams_.empty()) return Status::Ok();
  if (device->event == nullptr) {
    MPISTRATEGY_RETURN_IF_ERROR(stream->NewEvent(&device->event));
  }
  for (const std::shared_ptr<Stream>& s : streams_) {
    MPISTRATEGY_RETURN_IF_ERROR(s->Record(device->event.get()));
    MPISTRATEGY_RETURN_IF_ERROR(stream->Wait(device->event.get()));
  }
  return Status::Ok();
}

Status Executor::ForkStreams(Device* device,
                             const std::shared_ptr<Stream>& stream) {
  device->buffer_stream = stream;
  if (streams_.empty()) return Status::Ok();
  MPISTRATEGY_RETURN_IF_ERROR(stream->Record(device->event.get()));
  for (const std::shared_ptr<Stream>& s : streams_) {
    MPISTRATEGY_RETURN_IF_ERROR(s->Wait(device->event.get()));
  }
  return Status::Ok();
}

Status Executor::Execute(const std::vector<const Response*>& responses,
                         const std::vector<TensorEntry*>& entries,
                         std::vector<Status>* entry_status) {
  entry_status->assign(entries.size(), Status::Ok());
  handoff_ = nullptr;
  const Response& first = *responses[0];
  Bucket bucket;
  MPISTRATEGY_RETURN_IF_ERROR(BucketFor(first, entries, &bucket));
  const bool host = bucket.stream->host_synchronous();
  const std::shared_ptr<Stream>* device_stream =
      host ? nullptr : &entries[0]->device_context->stream();
  if (device_stream != nullptr) {
    MPISTRATEGY_RETURN_IF_ERROR(
        JoinStreams(bucket.device, *device_stream, entries));
  }
  traced_ = false;
  const double start = timeline_ != nullptr ? timeline_->Now() : 0.0;
  Status s = Run(bucket, responses, entries, entry_status);
  // A fused host allreduce, or one the plane reduces in parts, records its
  // copies and its collective itself.
  if (timeline_ != nullptr && !traced_) {
    // Device buckets: the time to enqueue the work on the op's stream.
    Trace(TimelineCollectiveName(ToCollectiveType(first.type)), responses,
          entries, start, timeline_->Now());
  }
  if (device_stream != nullptr) {
    for (TensorEntry* e : entries) {
      e->device_context->set_async_status(bucket.device->plane->async_status());
    }
    MPISTRATEGY_RETURN_IF_ERROR(s);
    return ForkStreams(bucket.device, *device_stream);
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
    if (handoff_ != nullptr && activity != kTimelineMemcpyIn &&
        activity != kTimelineMemcpyOut) {
      args.Add("handoff", handoff_);
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
  traced_ = true;
}

Status Executor::Run(const Bucket& bucket,
                     const std::vector<const Response*>& responses,
                     const std::vector<TensorEntry*>& entries,
                     std::vector<Status>* entry_status) {
  const Response& first = *responses[0];
  switch (first.type) {
    case ResponseType::kAllreduce:
      return Allreduce(bucket, responses, entries);
    case ResponseType::kAllgather:
      return Allgather(bucket, first, entries[0], &(*entry_status)[0]);
    case ResponseType::kBroadcast:
      return Broadcast(bucket, first, entries[0]);
    case ResponseType::kReducescatter:
      return Reducescatter(bucket, first, entries[0], &(*entry_status)[0]);
    case ResponseType::kAlltoall:
      return Alltoall(bucket, first, entries[0], &(*entry_status)[0]);
    case ResponseType::kBarrier:
      return transport_->Barrier();
    case ResponseType::kError:
      break;
  }
  return Status::Internal("Executor::Execute given an error response");
}

Status Executor::Allreduce(const Bucket& bucket,
                           const std::vector<const Response*>& responses,
                           const std::vector<TensorEntry*>& entries) {
  const Response& first = *responses[0];
  const DataType dtype = first.dtype;
  const ReduceOp op = first.reduce_op;
  DataPlane* plane = bucket.device->plane;
  Stream* stream = bucket.stream;
  if (responses.size() == 1 && !first.packed_dtypes.empty()) {
    return AllreduceMixedPack(bucket, first, entries[0]);
  }
  const bool host = stream->host_synchronous();
  const bool takes_parts = host && plane->reduces_parts();
  if (!takes_parts) {
    for (TensorEntry* e : entries) {
      if (!e->packed_outputs.empty()) {
        return Status::Internal(
            "group \"" + e->name + "\" has outputs of its own (" +
            "packed_outputs) on the " + plane->name() +
            " plane, which does not reduce tensors where they are");
      }
      if (!e->packed_inputs.empty()) PackInputs(e);
    }
  }
  if (responses.size() == 1 && entries[0]->packed_inputs.empty()) {
    // The big-tensor path: straight from input to output, no copies.
    TensorEntry* e = entries[0];
    const int64_t count = NumElements(first.shapes[0]);
    if (count == 0) return Status::Ok();
    MPISTRATEGY_RETURN_IF_ERROR(
        plane->Allreduce(e->input, e->output, count, dtype, op, stream));
    handoff_ = plane->last_allreduce_handoff();
    return Status::Ok();
  }
  const int64_t element_size = DataTypeSize(dtype);
  int64_t total = 0;
  for (const Response* r : responses) total += NumElements(r->shapes[0]);
  if (total == 0) {
    if (timeline_ != nullptr && host) {
      const double now = timeline_->Now();
      Trace(TimelineCollectiveName(CollectiveType::kAllreduce), responses,
            entries, now, now);
    }
    return Status::Ok();
  }
  if (takes_parts) {
    // The plane reads and writes the tensors itself: no fusion buffer, and
    // a group the kernel did not pack is reduced from where its tensors are.
    parts_.clear();
    for (size_t k = 0; k < responses.size(); ++k) {
      if (entries[k]->packed_inputs.empty()) {
        parts_.push_back({entries[k]->input, entries[k]->output,
                          NumElements(responses[k]->shapes[0])});
      } else {
        AppendPackedParts(entries[k]);
      }
    }
    const double t0 = timeline_ != nullptr ? timeline_->Now() : 0.0;
    MPISTRATEGY_RETURN_IF_ERROR(
        plane->AllreduceParts(parts_, dtype, op, stream));
    handoff_ = plane->last_allreduce_handoff();
    if (timeline_ != nullptr) {
      Trace(TimelineCollectiveName(CollectiveType::kAllreduce), responses,
            entries, t0, timeline_->Now());
    }
    return Status::Ok();
  }
  // Timeline marks (host buckets): before the copies in, the collective,
  // the copies out.
  const bool trace = timeline_ != nullptr && host;
  double t0 = 0.0;
  double t1 = 0.0;
  double t2 = 0.0;
  if (trace) t0 = timeline_->Now();
  char* buffer = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(Buffer(bucket, total * element_size, &buffer));
  int64_t offset = 0;
  for (size_t k = 0; k < responses.size(); ++k) {
    const int64_t bytes = NumElements(responses[k]->shapes[0]) * element_size;
    MPISTRATEGY_RETURN_IF_ERROR(stream->Memcpy(
        buffer + offset, entries[k]->input, bytes, CopyKind::kDeviceToDevice));
    offset += bytes;
  }
  if (trace) t1 = timeline_->Now();
  // On the host, MEAN's division rides on the copies out (Divide is as cheap
  // as a copy) instead of being a pass of its own over the buffer.
  const bool divide_on_copy_out = host && op == ReduceOp::kMean;
  MPISTRATEGY_RETURN_IF_ERROR(plane->Allreduce(
      buffer, buffer, total, dtype, divide_on_copy_out ? ReduceOp::kSum : op,
      stream));
  handoff_ = plane->last_allreduce_handoff();
  if (trace) t2 = timeline_->Now();
  offset = 0;
  for (size_t k = 0; k < responses.size(); ++k) {
    const int64_t count = NumElements(responses[k]->shapes[0]);
    const int64_t bytes = count * element_size;
    if (divide_on_copy_out) {
      MPISTRATEGY_RETURN_IF_ERROR(Divide(dtype, buffer + offset,
                                         entries[k]->output, count,
                                         plane->size()));
    } else {
      MPISTRATEGY_RETURN_IF_ERROR(
          stream->Memcpy(entries[k]->output, buffer + offset, bytes,
                         CopyKind::kDeviceToDevice));
    }
    offset += bytes;
  }
  if (trace) {
    const double t3 = timeline_->Now();
    Trace(kTimelineMemcpyIn, responses, entries, t0, t1);
    Trace(TimelineCollectiveName(CollectiveType::kAllreduce), responses,
          entries, t1, t2);
    Trace(kTimelineMemcpyOut, responses, entries, t2, t3);
  }
  return Status::Ok();
}

void Executor::PackInputs(TensorEntry* entry) {
  char* buffer = static_cast<char*>(entry->output);
  ForEachPackedPiece(
      *entry,
      [buffer](int64_t offset, int64_t bytes) {
        std::memset(buffer + offset, 0, bytes);
      },
      [buffer, entry](int i, int64_t offset, int64_t bytes) {
        std::memcpy(buffer + offset, entry->packed_inputs[i], bytes);
      });
  entry->input = entry->output;
  entry->packed_inputs.clear();
}

void Executor::AppendPackedParts(TensorEntry* entry) {
  char* buffer = static_cast<char*>(entry->output);
  const int64_t esize = DataTypeSize(entry->dtype);
  const bool own_outputs = !entry->packed_outputs.empty();
  // Only the tensors: the gaps are never read.  The other ranks append the
  // same parts (reduces_parts() is the same on every rank), so every rank's
  // plane call covers the same elements, wherever each rank's outputs are.
  ForEachPackedPiece(
      *entry, [](int64_t, int64_t) {},
      [this, buffer, entry, esize, own_outputs](int i, int64_t offset,
                                                int64_t bytes) {
        void* out = own_outputs ? entry->packed_outputs[i] : buffer + offset;
        parts_.push_back({entry->packed_inputs[i], out, bytes / esize});
      });
}

Status Executor::AllreduceMixedPack(const Bucket& bucket,
                                    const Response& response,
                                    TensorEntry* entry) {
  // The kernel packed the group into one buffer that is both input and
  // output; each dtype's segment is one plane call.
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
    MPISTRATEGY_RETURN_IF_ERROR(bucket.device->plane->Allreduce(
        data, data, segment.elements, segment.dtype, response.reduce_op,
        bucket.stream));
    // The timeline shows the last segment's.
    handoff_ = bucket.device->plane->last_allreduce_handoff();
  }
  return Status::Ok();
}

Status Executor::Allgather(const Bucket& bucket, const Response& response,
                           TensorEntry* entry, Status* entry_status) {
  int64_t rows = 0;
  int64_t total_bytes = 0;
  AllgatherLayout(response, size_, &counts_, &rows, &total_bytes);
  void* out = nullptr;
  *entry_status =
      AllocateOutput(entry, WithFirstDim(response.shapes[0], rows), &out);
  if (total_bytes == 0) return Status::Ok();
  if (out == nullptr) {
    char* scratch = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(Buffer(bucket, total_bytes, &scratch));
    out = scratch;
  }
  return bucket.device->plane->Allgatherv(entry->input, out, counts_,
                                          bucket.stream);
}

Status Executor::Broadcast(const Bucket& bucket, const Response& response,
                           TensorEntry* entry) {
  const int64_t bytes =
      NumElements(response.shapes[0]) * DataTypeSize(response.dtype);
  if (bytes == 0) return Status::Ok();
  if (rank_ == response.root_rank && entry->input != entry->output) {
    MPISTRATEGY_RETURN_IF_ERROR(bucket.stream->Memcpy(
        entry->output, entry->input, bytes, CopyKind::kDeviceToDevice));
  }
  return bucket.device->plane->Broadcast(entry->output, bytes,
                                         response.root_rank, bucket.stream);
}

Status Executor::Reducescatter(const Bucket& bucket, const Response& response,
                               TensorEntry* entry, Status* entry_status) {
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
    // Also when this rank's block is empty: planes want a valid pointer.
    char* scratch = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(Buffer(
        bucket,
        std::max(counts_[rank_], int64_t{1}) * DataTypeSize(response.dtype),
        &scratch));
    out = scratch;
  }
  return bucket.device->plane->Reducescatter(entry->input, out, counts_,
                                             response.dtype,
                                             response.reduce_op,
                                             bucket.stream);
}

Status Executor::Alltoall(const Bucket& bucket, const Response& response,
                          TensorEntry* entry, Status* entry_status) {
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
    if (out == nullptr) {
      char* scratch = nullptr;
      MPISTRATEGY_RETURN_IF_ERROR(
          Buffer(bucket, std::max(my_rows * row_bytes, int64_t{1}), &scratch));
      out = scratch;
    }
    MPISTRATEGY_RETURN_IF_ERROR(bucket.device->plane->Alltoallv(
        entry->input, counts_, out, counts2_, bucket.stream));
  }
  if (entry_status->ok() && entry->set_received_splits) {
    entry->set_received_splits(received_rows);
  }
  return Status::Ok();
}

}  // namespace mpistrategy
