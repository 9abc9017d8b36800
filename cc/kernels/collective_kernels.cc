// CPU kernels of the ops in cc/ops/mpi_ops.cc: the kernel family of
// collective_kernels.h on the CPU device policy.  The GPU kernels
// (collective_kernels_gpu.cc, CUDA build) are the same templates on the GPU
// policy; the entry's device always comes from the kernel's context
// (EngineDevice in tf_adapter.h).

#include <cstring>
#include <utility>

#include "cc/kernels/collective_kernels.h"

namespace mpistrategy {
namespace kernels {
namespace {

// Host memory; the output is ready when the engine calls `done`.
struct CpuDevice {
  struct Op {};

  // Host memory: the engine packs a group or reduces it where it is.
  static constexpr bool kEngineReadsInputs = true;

  static absl::Status Prepare(OpKernelContext* /*ctx*/,
                              const std::string& /*kernel*/, Op* /*op*/) {
    return absl::OkStatus();
  }

  static void Attach(const Op& /*op*/, TensorEntry* entry, Tensor keep_alive,
                     FinishCallback finish) {
    entry->done = [keep_alive = std::move(keep_alive),
                   finish = std::move(finish)](const Status& status) mutable {
      // Let go of the input before TF sees the op done: the next op may
      // then reuse the buffer in place, which TF allows only when it holds
      // the buffer's sole reference.
      keep_alive = Tensor();
      finish(ToTfStatus(status));
    };
  }

  static absl::Status Copy(const Op& /*op*/, void* dst, const void* src,
                           int64_t bytes) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }

  static absl::Status Zero(const Op& /*op*/, void* dst, int64_t bytes) {
    std::memset(dst, 0, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
};

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::register_kernel::Name;

REGISTER_KERNEL_BUILDER(Name("MpiStrategyAllreduce").Device(DEVICE_CPU),
                        AllreduceKernel<CpuDevice>);
REGISTER_KERNEL_BUILDER(
    Name("MpiStrategyGroupedAllreduce").Device(DEVICE_CPU),
    GroupedAllreduceKernel<CpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyAllgather").Device(DEVICE_CPU),
                        AllgatherKernel<CpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyBroadcast").Device(DEVICE_CPU),
                        BroadcastKernel<CpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyReducescatter").Device(DEVICE_CPU),
                        ReducescatterKernel<CpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyAlltoall").Device(DEVICE_CPU),
                        AlltoallKernel<CpuDevice>);
REGISTER_KERNEL_BUILDER(Name("MpiStrategyBarrier").Device(DEVICE_CPU),
                        BarrierKernel<CpuDevice>);

}  // namespace
}  // namespace kernels
}  // namespace mpistrategy
