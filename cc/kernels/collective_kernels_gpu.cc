// GPU kernels of the ops in cc/ops/mpi_ops.cc (CUDA build only): the kernel
// family of collective_kernels.h on the GPU device policy below.  A GPU entry
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

#include <cuda_runtime_api.h>

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
#include "cc/kernels/collective_kernels.h"
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
namespace kernels {
namespace {

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

// The op's stream, CUDA device, EventMgr and allocator; the output is ready
// once the stream has run the collective (EventMgr::ThenExecute: no thread
// blocks).
struct GpuDevice {
  struct Op {
    stream_executor::Stream* stream = nullptr;
    tensorflow::EventMgr* event_mgr = nullptr;
    tensorflow::Allocator* allocator = nullptr;
    void* cuda_stream = nullptr;
    int ordinal = 0;
  };

  // Device memory: the kernel packs a group on the op's stream.
  static constexpr bool kEngineReadsInputs = false;

  // DeviceContext -> se::Stream -> CUstream.
  static absl::Status Prepare(OpKernelContext* ctx, const std::string& kernel,
                              Op* op) {
    tensorflow::DeviceContext* dc = ctx->op_device_context();
    op->stream = dc == nullptr ? nullptr : dc->stream();
    if (op->stream == nullptr) {
      return absl::InternalError(absl::StrCat(
          "mpistrategy GPU kernel '", kernel, "' has no GPU stream"));
    }
    op->cuda_stream = op->stream->platform_specific_handle().stream;
    const tensorflow::DeviceBase::AcceleratorDeviceInfo* info =
        ctx->device()->tensorflow_accelerator_device_info();
    if (op->cuda_stream == nullptr || info == nullptr ||
        info->event_mgr == nullptr) {
      return absl::InternalError(absl::StrCat(
          "mpistrategy GPU kernel '", kernel,
          "' runs on a device without a CUDA stream or EventMgr"));
    }
    op->event_mgr = info->event_mgr;
    op->ordinal = op->stream->parent()->device_ordinal();
    op->allocator =
        ctx->device()->GetAllocator(tensorflow::AllocatorAttributes());
    return absl::OkStatus();
  }

  static void Attach(const Op& op, TensorEntry* entry, Tensor keep_alive,
                     FinishCallback finish) {
    auto context = std::make_shared<GpuDeviceContext>(
        op.ordinal, op.cuda_stream, op.allocator);
    entry->device_context = context;
    entry->done = [context, stream = op.stream, event_mgr = op.event_mgr,
                   keep_alive = std::move(keep_alive),
                   finish = std::move(finish)](const Status& status) mutable {
      if (!status.ok()) {
        keep_alive = Tensor();
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
  }

  // On the op's stream, after the work that produced the inputs.
  static absl::Status Copy(const Op& op, void* dst, const void* src,
                           int64_t bytes) {
    cudaError_t e = cudaSetDevice(op.ordinal);
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                          cudaMemcpyDeviceToDevice,
                          static_cast<cudaStream_t>(op.cuda_stream));
    }
    if (e != cudaSuccess) {
      return absl::InternalError(absl::StrCat(
          "mpistrategy: packing a grouped allreduce failed: ",
          cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }

  static absl::Status Zero(const Op& op, void* dst, int64_t bytes) {
    cudaError_t e = cudaSetDevice(op.ordinal);
    if (e == cudaSuccess) {
      e = cudaMemsetAsync(dst, 0, static_cast<size_t>(bytes),
                          static_cast<cudaStream_t>(op.cuda_stream));
    }
    if (e != cudaSuccess) {
      return absl::InternalError(absl::StrCat(
          "mpistrategy: packing a grouped allreduce failed: ",
          cudaGetErrorString(e)));
    }
    return absl::OkStatus();
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
                        AllreduceKernel<GpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyGroupedAllreduce")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_ALL_TYPES),
                        GroupedAllreduceKernel<GpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyAllgather")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_ALL_TYPES),
                        AllgatherKernel<GpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyBroadcast")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_ALL_TYPES),
                        BroadcastKernel<GpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyReducescatter")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_NUMERIC_TYPES),
                        ReducescatterKernel<GpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyAlltoall")
                            .Device(DEVICE_GPU)
                            .TypeConstraint("T", MPISTRATEGY_GPU_ALL_TYPES)
                            .HostMemory("splits")
                            .HostMemory("received_splits"),
                        AlltoallKernel<GpuDevice>);

}  // namespace
}  // namespace kernels
}  // namespace mpistrategy

#endif  // GOOGLE_CUDA
