// GPU kernels of the ops in cc/ops/mpi_ops.cc (CUDA build only).
//
// They mirror the CPU kernels (collective_kernels.cc): validate, wrap the
// tensors in a TensorEntry, enqueue it with the engine, return.  A GPU entry
// also carries a GpuDeviceContext (cc/engine/device.h): the op's CUDA
// stream with the device's allocator, and the factory of the GPU data plane
// (cc/transport/nccl_plane.h), on which the executor enqueues the
// collective.  TF's `done` runs once the stream has executed the collective
// (EventMgr::ThenExecute: no thread blocks), with the error the NCCL
// communicator reported in the meantime, if any.
//
// Dtypes: float16, bfloat16, float32, float64, int64, uint8, int8 and bool
// (not reducescatter).  int32 tensors live in host memory in TF, so int32
// collectives run the CPU kernels.

#if GOOGLE_CUDA

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cc/common/common.h"
#include "cc/common/stream.h"
#include "cc/device/cuda_stream.h"
#include "cc/engine/device.h"
#include "cc/engine/engine.h"
#include "cc/kernels/engine_holder.h"
#include "cc/kernels/tf_adapter.h"
#include "cc/transport/nccl_plane.h"
#include "tensorflow/core/common_runtime/device/device_event_mgr.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"

namespace mpistrategy {
namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

// The op's CUDA stream, with device memory from TF's allocator.
class TfCudaStream : public CudaStream {
 public:
  // `allocator`: the device's allocator; not owned, lives as long as the
  // process (TF never destroys its GPU allocators).
  TfCudaStream(int ordinal, void* stream, tensorflow::Allocator* allocator)
      : CudaStream(ordinal, stream), allocator_(allocator) {}

  Status Allocate(int64_t bytes, std::shared_ptr<void>* buffer) override {
    void* data = allocator_->AllocateRaw(
        tensorflow::Allocator::kAllocatorAlignment, static_cast<size_t>(bytes));
    if (data == nullptr) {
      return Status::Internal(
          "out of GPU memory: mpistrategy could not allocate its " +
          std::to_string(bytes) + "-byte fusion buffer from " +
          allocator_->Name() + " (lower fusion_threshold_bytes)");
    }
    tensorflow::Allocator* allocator = allocator_;
    *buffer = std::shared_ptr<void>(
        data, [allocator](void* p) { allocator->DeallocateRaw(p); });
    return Status::Ok();
  }

 private:
  tensorflow::Allocator* const allocator_;
};

// The engine's handle on one op's GPU.
class GpuDeviceContext : public DeviceContext {
 public:
  // Args:
  //   ordinal: CUDA device of the op.
  //   stream: the op's cudaStream_t.
  //   allocator: the device's allocator (see TfCudaStream).
  GpuDeviceContext(int ordinal, void* stream,
                   tensorflow::Allocator* allocator)
      : ordinal_(ordinal),
        stream_(std::make_shared<TfCudaStream>(ordinal, stream, allocator)) {}

  int ordinal() const override { return ordinal_; }
  const std::shared_ptr<Stream>& stream() const override { return stream_; }

  Status CreatePlane(Transport* control, bool hierarchical_allreduce,
                     int32_t device,
                     std::unique_ptr<DataPlane>* plane) const override {
    return CreateNcclPlane(control, hierarchical_allreduce, device, ordinal_,
                           plane);
  }

 private:
  const int ordinal_;
  const std::shared_ptr<Stream> stream_;
};

// What an op's entries need from its GPU.
struct OpGpu {
  stream_executor::Stream* stream = nullptr;
  tensorflow::EventMgr* event_mgr = nullptr;
  tensorflow::Allocator* allocator = nullptr;
  void* cuda_stream = nullptr;
  int ordinal = 0;

  std::shared_ptr<GpuDeviceContext> NewContext() const {
    return std::make_shared<GpuDeviceContext>(ordinal, cuda_stream, allocator);
  }
};

// Base of the GPU collective kernels.
class GpuCollectiveKernel : public AsyncOpKernel {
 public:
  explicit GpuCollectiveKernel(OpKernelConstruction* context)
      : AsyncOpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("tensor_name", &tensor_name_));
    if (tensor_name_.empty()) tensor_name_ = name();
  }

 protected:
  const std::string& tensor_name() const { return tensor_name_; }

  // The running engine, or null after failing the op (and calling `done`).
  static std::shared_ptr<Engine> EngineOrFail(OpKernelContext* ctx,
                                              const DoneCallback& done) {
    std::shared_ptr<Engine> engine = EngineHolder::Instance().Get();
    if (engine == nullptr) {
      ctx->SetStatus(absl::FailedPreconditionError(
          "mpistrategy is not initialized; call mpistrategy.init()"));
      done();
      return nullptr;
    }
    // A fork child would enqueue to an engine whose thread is not there.
    const Status forked = EngineHolder::Instance().ForkedChildError();
    if (!forked.ok()) {
      ctx->SetStatus(ToTfStatus(forked));
      done();
      return nullptr;
    }
    return engine;
  }

  // The op's stream (DeviceContext -> se::Stream -> CUstream), CUDA device,
  // EventMgr and allocator.
  absl::Status GetGpu(OpKernelContext* ctx, OpGpu* gpu) const {
    tensorflow::DeviceContext* dc = ctx->op_device_context();
    gpu->stream = dc == nullptr ? nullptr : dc->stream();
    if (gpu->stream == nullptr) {
      return absl::InternalError(absl::StrCat(
          "mpistrategy GPU kernel '", name(), "' has no GPU stream"));
    }
    gpu->cuda_stream = gpu->stream->platform_specific_handle().stream;
    const tensorflow::DeviceBase::AcceleratorDeviceInfo* info =
        ctx->device()->tensorflow_accelerator_device_info();
    if (gpu->cuda_stream == nullptr || info == nullptr ||
        info->event_mgr == nullptr) {
      return absl::InternalError(absl::StrCat(
          "mpistrategy GPU kernel '", name(),
          "' runs on a device without a CUDA stream or EventMgr"));
    }
    gpu->event_mgr = info->event_mgr;
    gpu->ordinal = gpu->stream->parent()->device_ordinal();
    gpu->allocator =
        ctx->device()->GetAllocator(tensorflow::AllocatorAttributes());
    return absl::OkStatus();
  }

  // Fills the entry's common fields from `input`.
  static absl::Status DescribeInput(OpKernelContext* ctx, const Tensor& input,
                                    TensorEntry* entry) {
    TF_RETURN_IF_ERROR(ToEngineDataType(input.dtype(), &entry->dtype));
    entry->shape = ToEngineShape(input.shape());
    entry->device = EngineDevice(ctx);
    entry->input = input.NumElements() > 0 ? input.data() : nullptr;
    return absl::OkStatus();
  }

  // An allocate_output callback for output `index` of `ctx` (device memory).
  static std::function<Status(const Shape&, void**)> OutputAllocator(
      OpKernelContext* ctx, int index) {
    return [ctx, index](const Shape& shape, void** data) -> Status {
      TensorShape tf_shape;
      absl::Status status = ToTfShape(shape, &tf_shape);
      Tensor* output = nullptr;
      if (status.ok()) status = ctx->allocate_output(index, tf_shape, &output);
      if (!status.ok()) return FromTfStatus(status);
      *data = output->NumElements() > 0 ? output->data() : nullptr;
      return Status::Ok();
    };
  }

  // Completes an op with a status (OK or the collective's error).
  using FinishCallback = std::function<void(const absl::Status&)>;

  // The FinishCallback of a single-entry op.
  static FinishCallback Finisher(OpKernelContext* ctx, DoneCallback done) {
    return [ctx, done = std::move(done)](const absl::Status& status) {
      if (!status.ok()) ctx->SetStatus(status);
      done();
    };
  }

  // Gives the entry a device context and a done-callback that calls
  // `finish` once the stream has run the collective (or at once with the
  // engine's error), then enqueues it.  `keep_alive` (the input) is held
  // until then.
  static void Submit(Engine* engine, const OpGpu& gpu, TensorEntry entry,
                     Tensor keep_alive, FinishCallback finish) {
    std::shared_ptr<GpuDeviceContext> context = gpu.NewContext();
    entry.device_context = context;
    entry.done = [context, stream = gpu.stream, event_mgr = gpu.event_mgr,
                  keep_alive = std::move(keep_alive),
                  finish = std::move(finish)](const Status& status) mutable {
      if (!status.ok()) {
        finish(ToTfStatus(status));
        return;
      }
      // Read on the engine thread, which set it before calling us.
      std::shared_ptr<const AsyncStatus> async = context->async_status();
      event_mgr->ThenExecute(
          stream, [async = std::move(async),
                   keep_alive = std::move(keep_alive),
                   finish = std::move(finish)]() mutable {
            // The stream is past the collective; let go of the input
            // before TF sees the op done, so the next op may reuse it.
            keep_alive = Tensor();
            finish(async == nullptr ? absl::OkStatus()
                                    : ToTfStatus(async->Get()));
          });
    };
    engine->Enqueue(std::move(entry));
  }

 private:
  std::string tensor_name_;
};

class GpuReducingKernel : public GpuCollectiveKernel {
 public:
  explicit GpuReducingKernel(OpKernelConstruction* context)
      : GpuCollectiveKernel(context) {
    std::string reduce_op;
    OP_REQUIRES_OK(context, context->GetAttr("reduce_op", &reduce_op));
    OP_REQUIRES_OK(context, ParseReduceOp(reduce_op, &reduce_op_));
  }

 protected:
  ReduceOp reduce_op() const { return reduce_op_; }

 private:
  ReduceOp reduce_op_ = ReduceOp::kSum;
};

class AllreduceGpuKernel : public GpuReducingKernel {
 public:
  using GpuReducingKernel::GpuReducingKernel;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::shared_ptr<Engine> engine = EngineOrFail(ctx, done);
    if (engine == nullptr) return;
    OpGpu gpu;
    OP_REQUIRES_OK_ASYNC(ctx, GetGpu(ctx, &gpu), done);
    const Tensor& input = ctx->input(0);
    TensorEntry entry;
    entry.type = CollectiveType::kAllreduce;
    entry.name = tensor_name();
    entry.reduce_op = reduce_op();
    OP_REQUIRES_OK_ASYNC(ctx, DescribeInput(ctx, input, &entry), done);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx,
                         ctx->forward_input_or_allocate_output(
                             {0}, 0, input.shape(), &output),
                         done);
    entry.output = output->NumElements() > 0 ? output->data() : nullptr;
    Submit(engine.get(), gpu, std::move(entry), input,
           Finisher(ctx, std::move(done)));
  }
};

// One allreduce per input; the op completes when the last one's stream
// work has run, with the first error any of them reported.
class GroupedAllreduceGpuKernel : public GpuReducingKernel {
 public:
  using GpuReducingKernel::GpuReducingKernel;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::shared_ptr<Engine> engine = EngineOrFail(ctx, done);
    if (engine == nullptr) return;
    OpGpu gpu;
    OP_REQUIRES_OK_ASYNC(ctx, GetGpu(ctx, &gpu), done);
    const int n = ctx->num_inputs();
    std::vector<TensorEntry> entries(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& input = ctx->input(i);
      TensorEntry& entry = entries[i];
      entry.type = CollectiveType::kAllreduce;
      entry.name = absl::StrCat(tensor_name(), ".", i);
      entry.reduce_op = reduce_op();
      OP_REQUIRES_OK_ASYNC(ctx, DescribeInput(ctx, input, &entry), done);
      Tensor* output = nullptr;
      OP_REQUIRES_OK_ASYNC(ctx,
                           ctx->forward_input_or_allocate_output(
                               {i}, i, input.shape(), &output),
                           done);
      entry.output = output->NumElements() > 0 ? output->data() : nullptr;
    }
    // Shared by the n entries; the last one completes the op.
    struct Group {
      std::atomic<int> remaining;
      std::mutex mu;
      absl::Status status;  // first error
      DoneCallback done;
    };
    auto group = std::make_shared<Group>();
    group->remaining = n;
    group->done = std::move(done);
    // Every entry is enqueued even if an earlier one was rejected, so the
    // other ranks never wait for a name this rank skipped.
    for (int i = 0; i < n; ++i) {
      Submit(engine.get(), gpu, std::move(entries[i]), ctx->input(i),
             [ctx, group](const absl::Status& status) {
               if (!status.ok()) {
                 std::lock_guard<std::mutex> lock(group->mu);
                 if (group->status.ok()) group->status = status;
               }
               if (group->remaining.fetch_sub(1) == 1) {
                 if (!group->status.ok()) ctx->SetStatus(group->status);
                 group->done();
               }
             });
    }
  }
};

class AllgatherGpuKernel : public GpuCollectiveKernel {
 public:
  using GpuCollectiveKernel::GpuCollectiveKernel;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::shared_ptr<Engine> engine = EngineOrFail(ctx, done);
    if (engine == nullptr) return;
    const Tensor& input = ctx->input(0);
    OpGpu gpu;
    OP_REQUIRES_OK_ASYNC(ctx, GetGpu(ctx, &gpu), done);
    TensorEntry entry;
    entry.type = CollectiveType::kAllgather;
    entry.name = tensor_name();
    OP_REQUIRES_OK_ASYNC(ctx, DescribeInput(ctx, input, &entry), done);
    entry.allocate_output = OutputAllocator(ctx, 0);
    Submit(engine.get(), gpu, std::move(entry), input,
           Finisher(ctx, std::move(done)));
  }
};

class BroadcastGpuKernel : public GpuCollectiveKernel {
 public:
  explicit BroadcastGpuKernel(OpKernelConstruction* context)
      : GpuCollectiveKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("root_rank", &root_rank_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::shared_ptr<Engine> engine = EngineOrFail(ctx, done);
    if (engine == nullptr) return;
    OpGpu gpu;
    OP_REQUIRES_OK_ASYNC(ctx, GetGpu(ctx, &gpu), done);
    const Tensor& input = ctx->input(0);
    TensorEntry entry;
    entry.type = CollectiveType::kBroadcast;
    entry.name = tensor_name();
    entry.root_rank = root_rank_;
    OP_REQUIRES_OK_ASYNC(ctx, DescribeInput(ctx, input, &entry), done);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx,
                         ctx->forward_input_or_allocate_output(
                             {0}, 0, input.shape(), &output),
                         done);
    entry.output = output->NumElements() > 0 ? output->data() : nullptr;
    Submit(engine.get(), gpu, std::move(entry), input,
           Finisher(ctx, std::move(done)));
  }

 private:
  int32_t root_rank_ = 0;
};

class ReducescatterGpuKernel : public GpuReducingKernel {
 public:
  using GpuReducingKernel::GpuReducingKernel;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::shared_ptr<Engine> engine = EngineOrFail(ctx, done);
    if (engine == nullptr) return;
    const Tensor& input = ctx->input(0);
    OpGpu gpu;
    OP_REQUIRES_OK_ASYNC(ctx, GetGpu(ctx, &gpu), done);
    TensorEntry entry;
    entry.type = CollectiveType::kReducescatter;
    entry.name = tensor_name();
    entry.reduce_op = reduce_op();
    OP_REQUIRES_OK_ASYNC(ctx, DescribeInput(ctx, input, &entry), done);
    entry.allocate_output = OutputAllocator(ctx, 0);
    Submit(engine.get(), gpu, std::move(entry), input,
           Finisher(ctx, std::move(done)));
  }
};

// `splits` and `received_splits` stay in host memory.
class AlltoallGpuKernel : public GpuCollectiveKernel {
 public:
  using GpuCollectiveKernel::GpuCollectiveKernel;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::shared_ptr<Engine> engine = EngineOrFail(ctx, done);
    if (engine == nullptr) return;
    const Tensor& input = ctx->input(0);
    const Tensor& splits = ctx->input(1);
    OP_REQUIRES_ASYNC(
        ctx, splits.dims() == 1,
        absl::InvalidArgumentError(absl::StrCat(
            "alltoall '", tensor_name(), "' needs 1-D splits, got shape ",
            splits.shape().DebugString())),
        done);
    OpGpu gpu;
    OP_REQUIRES_OK_ASYNC(ctx, GetGpu(ctx, &gpu), done);
    TensorEntry entry;
    entry.type = CollectiveType::kAlltoall;
    entry.name = tensor_name();
    OP_REQUIRES_OK_ASYNC(ctx, DescribeInput(ctx, input, &entry), done);
    const tensorflow::DataType splits_dtype = splits.dtype();
    entry.splits.resize(splits.NumElements());
    for (int64_t i = 0; i < splits.NumElements(); ++i) {
      entry.splits[i] = splits_dtype == tensorflow::DT_INT32
                            ? splits.flat<int32_t>()(i)
                            : splits.flat<int64_t>()(i);
    }
    entry.allocate_output = OutputAllocator(ctx, 0);
    auto splits_status = std::make_shared<absl::Status>();
    entry.set_received_splits = [ctx, splits_dtype, splits_status](
                                    const std::vector<int64_t>& received) {
      Tensor* output = nullptr;
      *splits_status = ctx->allocate_output(
          1, TensorShape({static_cast<int64_t>(received.size())}), &output);
      if (!splits_status->ok()) return;
      for (size_t i = 0; i < received.size(); ++i) {
        if (splits_dtype == tensorflow::DT_INT32) {
          output->flat<int32_t>()(i) = static_cast<int32_t>(received[i]);
        } else {
          output->flat<int64_t>()(i) = received[i];
        }
      }
    };
    Submit(engine.get(), gpu, std::move(entry), input,
           [ctx, splits_status, done = std::move(done)](
               const absl::Status& status) {
             if (!status.ok()) {
               ctx->SetStatus(status);
             } else if (!splits_status->ok()) {
               ctx->SetStatus(*splits_status);
             }
             done();
           });
  }
};

using ::tensorflow::DEVICE_GPU;
using ::tensorflow::register_kernel::Name;

#define MPISTRATEGY_GPU_NUMERIC_TYPES                                    \
  {                                                                     \
    ::tensorflow::DT_HALF, ::tensorflow::DT_BFLOAT16,                   \
        ::tensorflow::DT_FLOAT, ::tensorflow::DT_DOUBLE,                \
        ::tensorflow::DT_INT64, ::tensorflow::DT_UINT8,                 \
        ::tensorflow::DT_INT8                                           \
  }
#define MPISTRATEGY_GPU_ALL_TYPES                                        \
  {                                                                     \
    ::tensorflow::DT_HALF, ::tensorflow::DT_BFLOAT16,                   \
        ::tensorflow::DT_FLOAT, ::tensorflow::DT_DOUBLE,                \
        ::tensorflow::DT_INT64, ::tensorflow::DT_UINT8,                 \
        ::tensorflow::DT_INT8, ::tensorflow::DT_BOOL                    \
  }

REGISTER_KERNEL_BUILDER(Name("MpiStrategyAllreduce")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_ALL_TYPES),
                        AllreduceGpuKernel);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyGroupedAllreduce")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_ALL_TYPES),
                        GroupedAllreduceGpuKernel);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyAllgather")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_ALL_TYPES),
                        AllgatherGpuKernel);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyBroadcast")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_ALL_TYPES),
                        BroadcastGpuKernel);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyReducescatter")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_NUMERIC_TYPES),
                        ReducescatterGpuKernel);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyAlltoall")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_ALL_TYPES)
                            .HostMemory("splits")
                            .HostMemory("received_splits"),
                        AlltoallGpuKernel);

#undef MPISTRATEGY_GPU_NUMERIC_TYPES
#undef MPISTRATEGY_GPU_ALL_TYPES

}  // namespace
}  // namespace mpistrategy

#endif  // GOOGLE_CUDA
