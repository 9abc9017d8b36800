// The one set of check macros for calls into MPI, CUDA and NCCL.
//
// Each macro evaluates `call` once and, when it fails, returns a Status from
// the enclosing function that names the call and the library's own error
// text.  The macros are usable without the libraries' headers; the functions
// that word the errors are defined next to the library they read:
// checks_mpi.cc (target //cc/common:mpi_checks) and checks_cuda.cc
// (//cc/common:cuda_checks, --config=cuda only).
//
//   MPISTRATEGY_MPI_CHECK(MPI_Comm_dup(parent, &comm), "MPI_Comm_dup");
//   MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, kind, stream));
//   MPISTRATEGY_NCCL_CHECK(ncclAllReduce(...), comm);

#ifndef MPISTRATEGY_CC_COMMON_CHECKS_H_
#define MPISTRATEGY_CC_COMMON_CHECKS_H_

#include "cc/common/common.h"

namespace mpistrategy {

// Unavailable: "MPI error in <what>: <MPI_Error_string> (code <rc>)".
Status MpiError(int rc, const char* what);
// Internal: "CUDA error in <what>: <cudaGetErrorString>".  `code` is a
// cudaError_t.
Status CudaError(int code, const char* what);
// Unavailable: "NCCL error in <what>: <ncclGetErrorString> (<last error>)".
// `code` is an ncclResult_t, `comm` the ncclComm_t (may be null).
Status NcclError(int code, const char* what, void* comm);

}  // namespace mpistrategy

// `what` names the operation in the message (e.g. "MPI_Allreduce").
#define MPISTRATEGY_MPI_CHECK(call, what)                             \
  do {                                                                \
    const int mpistrategy_rc_ = (call);                               \
    if (mpistrategy_rc_ != 0 /* MPI_SUCCESS */) {                     \
      return ::mpistrategy::MpiError(mpistrategy_rc_, (what));        \
    }                                                                 \
  } while (0)

#define MPISTRATEGY_CUDA_CHECK(call)                                  \
  do {                                                                \
    const int mpistrategy_rc_ = static_cast<int>(call);               \
    if (mpistrategy_rc_ != 0 /* cudaSuccess */) {                     \
      return ::mpistrategy::CudaError(mpistrategy_rc_, #call);        \
    }                                                                 \
  } while (0)

#define MPISTRATEGY_NCCL_CHECK(call, comm)                                \
  do {                                                                    \
    const int mpistrategy_rc_ = static_cast<int>(call);                   \
    if (mpistrategy_rc_ != 0 /* ncclSuccess */) {                         \
      return ::mpistrategy::NcclError(mpistrategy_rc_, #call, (comm));    \
    }                                                                     \
  } while (0)

#endif  // MPISTRATEGY_CC_COMMON_CHECKS_H_
