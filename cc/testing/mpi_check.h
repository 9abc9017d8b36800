// Checks for the programs that run under mpirun outside googletest
// (cc/engine/mpi_transport_check.cc, tests/gpu/engine_check): a failed
// check prints the rank and the location and is counted, and the program
// goes on, so one run reports every failure.  The program sets
// `g_check_rank` once it knows its rank and returns non-zero when
// `g_check_failures` is not 0.
//
// Header-only, because tests/gpu/engine_check/run_engine_check.sh builds
// the device check with g++ alone (no Bazel) on the GPU machine.

#ifndef MPISTRATEGY_CC_TESTING_MPI_CHECK_H_
#define MPISTRATEGY_CC_TESTING_MPI_CHECK_H_

#include <cstdio>

#include "cc/common/common.h"

namespace mpistrategy {

inline int g_check_rank = 0;
inline int g_check_failures = 0;

}  // namespace mpistrategy

// CHECK_TRUE(cond, printf-format, args...)
#define CHECK_TRUE(cond, ...)                                           \
  do {                                                                  \
    if (!(cond)) {                                                      \
      ++::mpistrategy::g_check_failures;                                \
      std::fprintf(stderr, "[rank %d] FAILED %s:%d: %s: ",              \
                   ::mpistrategy::g_check_rank, __FILE__, __LINE__,     \
                   #cond);                                              \
      std::fprintf(stderr, __VA_ARGS__);                                \
      std::fprintf(stderr, "\n");                                       \
    }                                                                   \
  } while (0)

// CHECK_OK(expression returning a Status)
#define CHECK_OK(expr)                                                  \
  do {                                                                  \
    const ::mpistrategy::Status s_ = (expr);                            \
    CHECK_TRUE(s_.ok(), "%s: %s", #expr, s_.ToString().c_str());        \
  } while (0)

#endif  // MPISTRATEGY_CC_TESTING_MPI_CHECK_H_
