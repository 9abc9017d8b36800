// MpiError for MPISTRATEGY_MPI_CHECK (checks.h).

#include <mpi.h>

#include <string>

#include "cc/common/checks.h"

namespace mpistrategy {

static_assert(MPI_SUCCESS == 0, "MPISTRATEGY_MPI_CHECK assumes MPI_SUCCESS 0");

Status MpiError(int rc, const char* what) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  return Status::Unavailable(std::string("MPI error in ") + what + ": " +
                             std::string(text, len) + " (code " +
                             std::to_string(rc) + ")");
}

}  // namespace mpistrategy
