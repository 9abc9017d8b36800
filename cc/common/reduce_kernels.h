// Element-wise host reductions over the engine's dtypes.
//
// Used by FakeTransport (all reductions), the MPI transport (float16 and
// bfloat16 user-defined MPI_Ops), the shared-memory plane (ReducePair: its
// MEAN divides in the last pass of its sum) and the engine (MEAN = SUM /
// size).
// float16/bfloat16 values are widened to float32, combined and rounded back
// (round to nearest even) element by element.  bool: kSum/kMax are logical
// OR, kMin/kProduct logical AND.  kMean combines like kSum.

#ifndef MPISTRATEGY_CC_COMMON_REDUCE_KERNELS_H_
#define MPISTRATEGY_CC_COMMON_REDUCE_KERNELS_H_

#include <cstdint>

#include "cc/common/common.h"

namespace mpistrategy {

// inout[i] = op(inout[i], in[i]) for i in [0, count).  Thread-compatible.
void ReduceInto(DataType dtype, ReduceOp op, const void* in, void* inout,
                int64_t count);

// out[i] = op(a[i], b[i]) for i in [0, count), then, for a MEAN with
// `divisor` > 1, divided by `divisor`: in one pass (float16/bfloat16: two,
// as ReduceInto and Divide), each element rounded bit for bit as ReduceInto
// followed by Divide would round it.  A reduction
// of several buffers combines the first two into its result and then each
// further one into that, dividing in the last pass only.  `out` may be `a`
// or `b`; otherwise no two overlap.
//
// Returns:
//   InvalidArgument where `divisor` is not 1 and the op is not a MEAN of a
//   floating dtype, or `divisor` is not positive.
Status ReducePair(DataType dtype, ReduceOp op, const void* a, const void* b,
                  void* out, int64_t count, int64_t divisor);

// out[i] = in[i] / divisor for floating dtypes (float16/bfloat16 are
// rounded back to nearest even), bit for bit as the scalar division (a
// power-of-two divisor multiplies by its exact reciprocal).  `in` and `out`
// are the same buffer or do not overlap.  Vectorised, so that MEAN's
// division costs about what a copy costs: fold it into a copy that happens
// anyway (Divide from the source into the destination) rather than adding
// a pass.  Returns InvalidArgument for non-floating dtypes or divisor <= 0.
Status Divide(DataType dtype, const void* in, void* out, int64_t count,
              int64_t divisor);

// Divide(dtype, data, data, count, divisor).
Status DivideInPlace(DataType dtype, void* data, int64_t count,
                     int64_t divisor);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_COMMON_REDUCE_KERNELS_H_
