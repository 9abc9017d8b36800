// CudaError and NcclError for MPISTRATEGY_CUDA_CHECK / MPISTRATEGY_NCCL_CHECK
// (checks.h).  Host C++ against the CUDA runtime and NCCL headers; built
// with -DGOOGLE_CUDA=1 only.

#include "cc/common/checks.h"

#if GOOGLE_CUDA

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace mpistrategy {

static_assert(cudaSuccess == 0, "MPISTRATEGY_CUDA_CHECK assumes cudaSuccess 0");
static_assert(ncclSuccess == 0, "MPISTRATEGY_NCCL_CHECK assumes ncclSuccess 0");

Status CudaError(int code, const char* what) {
  return Status::Internal(
      std::string("CUDA error in ") + what + ": " +
      cudaGetErrorString(static_cast<cudaError_t>(code)));
}

Status NcclError(int code, const char* what, void* comm) {
  std::string message = std::string("NCCL error in ") + what + ": " +
                        ncclGetErrorString(static_cast<ncclResult_t>(code));
  const char* last = ncclGetLastError(static_cast<ncclComm_t>(comm));
  if (last != nullptr && last[0] != '\0') {
    message += std::string(" (") + last + ")";
  }
  return Status::Unavailable(message);
}

}  // namespace mpistrategy

#endif  // GOOGLE_CUDA
