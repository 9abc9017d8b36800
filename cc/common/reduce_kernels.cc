#include "cc/common/reduce_kernels.h"

#include <cstring>
#include <string>
#include <type_traits>

#include "cc/common/float16.h"

namespace mpistrategy {

namespace {

// On x86-64 with GCC, ReduceTyped and DivideTyped are compiled twice, for
// AVX2 and for the baseline (SSE2), and the loader picks one for the CPU (an
// ifunc): AVX2 halves the cost of a reduction or of MEAN's division pass,
// and the library still runs on any x86-64.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MPISTRATEGY_AVX2_CLONES \
  __attribute__((target_clones("avx2", "default")))
#else
#define MPISTRATEGY_AVX2_CLONES
#endif

// The element-wise combinations on GCC/Clang vector types (and on scalars:
// the same code serves the tail).  Sums and products of integers wrap: they
// are computed on the unsigned type of the same width.  Min and max follow
// std::min/std::max (the first operand on ties, so -0.0 and +0.0 keep
// their order), except that a NaN wins, the first operand's first, as in
// tf.minimum/tf.maximum.
struct SumOp {
  template <typename V>
  V operator()(V a, V b) const { return a + b; }
};
struct ProductOp {
  template <typename V>
  V operator()(V a, V b) const { return a * b; }
};
struct MinOp {
  template <typename V>
  V operator()(V a, V b) const {
    V r = b < a ? b : a;
    r = b != b ? b : r;
    return a != a ? a : r;
  }
};
struct MaxOp {
  template <typename V>
  V operator()(V a, V b) const {
    V r = a < b ? b : a;
    r = b != b ? b : r;
    return a != a ? a : r;
  }
};

// One float of a 16-bit reduction (Reduce16): the same rules as above.
float CombineFloat(ReduceOp op, float a, float b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      return SumOp()(a, b);
    case ReduceOp::kProduct:
      return ProductOp()(a, b);
    case ReduceOp::kMin:
      return MinOp()(a, b);
    case ReduceOp::kMax:
      return MaxOp()(a, b);
  }
  return a;
}

// inout[i] = op(inout[i], in[i]) on elements of type E (the dtype's type,
// or its unsigned twin for wrapping arithmetic), 32 bytes at a time:
// explicit SIMD whatever the optimisation level (-O2 does not vectorise a
// loop of unknown length), and safe when `in == inout`.
template <typename E, typename Op>
__attribute__((always_inline)) inline void CombineLoop(const void* in,
                                                       void* inout,
                                                       int64_t count, Op op) {
  typedef E Vector __attribute__((vector_size(32)));
  constexpr int64_t kLanes = sizeof(Vector) / sizeof(E);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(inout);
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    Vector a, b;
    std::memcpy(&a, dst + i * sizeof(E), sizeof(a));  // unaligned loads
    std::memcpy(&b, src + i * sizeof(E), sizeof(b));
    a = op(a, b);
    std::memcpy(dst + i * sizeof(E), &a, sizeof(a));
  }
  for (; i < count; ++i) {
    E a, b;
    std::memcpy(&a, dst + i * sizeof(E), sizeof(E));
    std::memcpy(&b, src + i * sizeof(E), sizeof(E));
    a = static_cast<E>(op(a, b));
    std::memcpy(dst + i * sizeof(E), &a, sizeof(E));
  }
}

template <typename T>
MPISTRATEGY_AVX2_CLONES void ReduceTyped(ReduceOp op, const void* in,
                                         void* inout, int64_t count) {
  using Wrapping = typename std::conditional<std::is_integral<T>::value,
                                             std::make_unsigned<T>,
                                             std::common_type<T>>::type::type;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      return CombineLoop<Wrapping>(in, inout, count, SumOp());
    case ReduceOp::kProduct:
      return CombineLoop<Wrapping>(in, inout, count, ProductOp());
    case ReduceOp::kMin:
      return CombineLoop<T>(in, inout, count, MinOp());
    case ReduceOp::kMax:
      return CombineLoop<T>(in, inout, count, MaxOp());
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void Reduce16(ReduceOp op, const void* in, void* inout, int64_t count) {
  const uint16_t* src = static_cast<const uint16_t*>(in);
  uint16_t* dst = static_cast<uint16_t*>(inout);
  for (int64_t i = 0; i < count; ++i) {
    dst[i] = FromFloat(CombineFloat(op, ToFloat(dst[i]), ToFloat(src[i])));
  }
}

void ReduceBool(ReduceOp op, const void* in, void* inout, int64_t count) {
  const uint8_t* src = static_cast<const uint8_t*>(in);
  uint8_t* dst = static_cast<uint8_t*>(inout);
  const bool is_or = op == ReduceOp::kSum || op == ReduceOp::kMean ||
                     op == ReduceOp::kMax;
  for (int64_t i = 0; i < count; ++i) {
    const bool a = dst[i] != 0;
    const bool b = src[i] != 0;
    dst[i] = static_cast<uint8_t>(is_or ? (a || b) : (a && b));
  }
}

// A power of two has an exact reciprocal, and then x * (1 / d) is the same
// IEEE result as x / d (both round the same exact value once), subnormals,
// infinities and NaN included; multiplying is several times cheaper.
bool IsPowerOfTwo(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void Divide16(const void* in, void* out, int64_t count, int64_t divisor) {
  const uint16_t* src = static_cast<const uint16_t*>(in);
  uint16_t* dst = static_cast<uint16_t*>(out);
  const float d = static_cast<float>(divisor);
  if (IsPowerOfTwo(divisor)) {
    const float r = 1.0f / d;
    for (int64_t i = 0; i < count; ++i) dst[i] = FromFloat(ToFloat(src[i]) * r);
    return;
  }
  for (int64_t i = 0; i < count; ++i) dst[i] = FromFloat(ToFloat(src[i]) / d);
}

// out[i] = in[i] / divisor (or * its exact reciprocal), 32 bytes at a time
// through GCC/Clang vector types: explicit SIMD whatever the optimisation
// level (-O2 does not vectorise a loop of unknown length), and safe when
// `in == out` (each block is loaded before it is stored).
template <typename T>
MPISTRATEGY_AVX2_CLONES void DivideTyped(const void* in, void* out, int64_t count, int64_t divisor) {
  typedef T Vector __attribute__((vector_size(32)));
  constexpr int64_t kLanes = sizeof(Vector) / sizeof(T);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const bool multiply = IsPowerOfTwo(divisor);
  const T d = static_cast<T>(divisor);
  const T r = static_cast<T>(1) / d;
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    Vector v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(v));  // unaligned load
    if (multiply) {
      v = v * r;
    } else {
      v = v / d;
    }
    std::memcpy(dst + i * sizeof(T), &v, sizeof(v));
  }
  for (; i < count; ++i) {
    T x;
    std::memcpy(&x, src + i * sizeof(T), sizeof(T));
    x = multiply ? x * r : x / d;
    std::memcpy(dst + i * sizeof(T), &x, sizeof(T));
  }
}

}  // namespace

void ReduceInto(DataType dtype, ReduceOp op, const void* in, void* inout,
                int64_t count) {
  switch (dtype) {
    case DataType::kUint8:
      return ReduceTyped<uint8_t>(op, in, inout, count);
    case DataType::kInt8:
      return ReduceTyped<int8_t>(op, in, inout, count);
    case DataType::kBool:
      return ReduceBool(op, in, inout, count);
    case DataType::kInt32:
      return ReduceTyped<int32_t>(op, in, inout, count);
    case DataType::kInt64:
      return ReduceTyped<int64_t>(op, in, inout, count);
    case DataType::kFloat16:
      return Reduce16<HalfToFloat, FloatToHalf>(op, in, inout, count);
    case DataType::kBFloat16:
      return Reduce16<BFloat16ToFloat, FloatToBFloat16>(op, in, inout, count);
    case DataType::kFloat32:
      return ReduceTyped<float>(op, in, inout, count);
    case DataType::kFloat64:
      return ReduceTyped<double>(op, in, inout, count);
  }
}

Status Divide(DataType dtype, const void* in, void* out, int64_t count,
              int64_t divisor) {
  if (divisor <= 0) {
    return Status::InvalidArgument("cannot divide by " +
                                   std::to_string(divisor));
  }
  switch (dtype) {
    case DataType::kFloat16:
      Divide16<HalfToFloat, FloatToHalf>(in, out, count, divisor);
      return Status::Ok();
    case DataType::kBFloat16:
      Divide16<BFloat16ToFloat, FloatToBFloat16>(in, out, count, divisor);
      return Status::Ok();
    case DataType::kFloat32:
      DivideTyped<float>(in, out, count, divisor);
      return Status::Ok();
    case DataType::kFloat64:
      DivideTyped<double>(in, out, count, divisor);
      return Status::Ok();
    default:
      return Status::InvalidArgument(std::string("cannot divide ") +
                                     DataTypeName(dtype) +
                                     " values (mean needs a floating dtype)");
  }
}

Status DivideInPlace(DataType dtype, void* data, int64_t count,
                     int64_t divisor) {
  return Divide(dtype, data, data, count, divisor);
}

}  // namespace mpistrategy
