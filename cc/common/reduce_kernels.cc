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

// A power of two has an exact reciprocal, and then x * (1 / d) is the same
// IEEE result as x / d (both round the same exact value once), subnormals,
// infinities and NaN included; multiplying is several times cheaper.
bool IsPowerOfTwo(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

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

// No division after the combination (every op but a MEAN's last pass).
struct Keep {
  template <typename V>
  V operator()(V v) const { return v; }
};
// A MEAN's division by a power of two: its exact reciprocal (IsPowerOfTwo).
template <typename T>
struct MultiplyBy {
  T r;
  template <typename V>
  V operator()(V v) const { return v * r; }
};
template <typename T>
struct DivideBy {
  T d;
  template <typename V>
  V operator()(V v) const { return v / d; }
};

// out[i] = finish(op(a[i], b[i])) on elements of type E (the dtype's type,
// or its unsigned twin for wrapping arithmetic), 32 bytes at a time:
// explicit SIMD whatever the optimisation level (-O2 does not vectorise a
// loop of unknown length), and safe when `out` is `a` or `b` (each block is
// loaded before it is stored).
template <typename E, typename Op, typename Finish>
__attribute__((always_inline)) inline void CombineLoop(const void* a,
                                                       const void* b,
                                                       void* out,
                                                       int64_t count, Op op,
                                                       Finish finish) {
  typedef E Vector __attribute__((vector_size(32)));
  constexpr int64_t kLanes = sizeof(Vector) / sizeof(E);
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  char* dst = static_cast<char*>(out);
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    Vector u, v;
    std::memcpy(&u, x + i * sizeof(E), sizeof(u));  // unaligned loads
    std::memcpy(&v, y + i * sizeof(E), sizeof(v));
    u = finish(op(u, v));
    std::memcpy(dst + i * sizeof(E), &u, sizeof(u));
  }
  for (; i < count; ++i) {
    E u, v;
    std::memcpy(&u, x + i * sizeof(E), sizeof(E));
    std::memcpy(&v, y + i * sizeof(E), sizeof(E));
    u = static_cast<E>(finish(static_cast<E>(op(u, v))));
    std::memcpy(dst + i * sizeof(E), &u, sizeof(E));
  }
}

template <typename T>
MPISTRATEGY_AVX2_CLONES void ReduceTyped(ReduceOp op, const void* a,
                                         const void* b, void* out,
                                         int64_t count, int64_t divisor) {
  using Wrapping = typename std::conditional<std::is_integral<T>::value,
                                             std::make_unsigned<T>,
                                             std::common_type<T>>::type::type;
  switch (op) {
    case ReduceOp::kSum:
      return CombineLoop<Wrapping>(a, b, out, count, SumOp(), Keep());
    case ReduceOp::kMean:
      // Only floating dtypes divide (ReducePair refuses a divisor otherwise).
      if constexpr (std::is_floating_point<T>::value) {
        if (divisor > 1 && IsPowerOfTwo(divisor)) {
          return CombineLoop<T>(a, b, out, count, SumOp(),
                                MultiplyBy<T>{T(1) / static_cast<T>(divisor)});
        }
        if (divisor > 1) {
          return CombineLoop<T>(a, b, out, count, SumOp(),
                                DivideBy<T>{static_cast<T>(divisor)});
        }
      }
      return CombineLoop<Wrapping>(a, b, out, count, SumOp(), Keep());
    case ReduceOp::kProduct:
      return CombineLoop<Wrapping>(a, b, out, count, ProductOp(), Keep());
    case ReduceOp::kMin:
      return CombineLoop<T>(a, b, out, count, MinOp(), Keep());
    case ReduceOp::kMax:
      return CombineLoop<T>(a, b, out, count, MaxOp(), Keep());
  }
}

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

// The sum (or other op) is rounded to 16 bits before the division, as
// ReduceInto and then Divide would round it.
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void Reduce16(ReduceOp op, const void* a, const void* b, void* out,
              int64_t count, int64_t divisor) {
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  uint16_t* dst = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < count; ++i) {
    dst[i] = FromFloat(CombineFloat(op, ToFloat(x[i]), ToFloat(y[i])));
  }
  // A second pass: 16-bit MEANs are divided before the sum by the Python
  // wrappers, so this one is rare.
  if (op == ReduceOp::kMean && divisor > 1) {
    Divide16<ToFloat, FromFloat>(out, out, count, divisor);
  }
}

void ReduceBool(ReduceOp op, const void* a, const void* b, void* out,
                int64_t count) {
  const uint8_t* x = static_cast<const uint8_t*>(a);
  const uint8_t* y = static_cast<const uint8_t*>(b);
  uint8_t* dst = static_cast<uint8_t*>(out);
  const bool is_or = op == ReduceOp::kSum || op == ReduceOp::kMean ||
                     op == ReduceOp::kMax;
  for (int64_t i = 0; i < count; ++i) {
    const bool u = x[i] != 0;
    const bool v = y[i] != 0;
    dst[i] = static_cast<uint8_t>(is_or ? (u || v) : (u && v));
  }
}

// out[i] = quotient(in[i]), 32 bytes at a time through GCC/Clang vector
// types: explicit SIMD whatever the optimisation level (-O2 does not
// vectorise a loop of unknown length), and safe when `in == out` (each
// block is loaded before it is stored).
template <typename T, typename Quotient>
__attribute__((always_inline)) inline void DivideLoop(const void* in,
                                                      void* out,
                                                      int64_t count,
                                                      Quotient quotient) {
  typedef T Vector __attribute__((vector_size(32)));
  constexpr int64_t kLanes = sizeof(Vector) / sizeof(T);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    Vector v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(v));  // unaligned load
    v = quotient(v);
    std::memcpy(dst + i * sizeof(T), &v, sizeof(v));
  }
  for (; i < count; ++i) {
    T x;
    std::memcpy(&x, src + i * sizeof(T), sizeof(T));
    x = quotient(x);
    std::memcpy(dst + i * sizeof(T), &x, sizeof(T));
  }
}

// out[i] = in[i] / divisor (or * its exact reciprocal).
template <typename T>
MPISTRATEGY_AVX2_CLONES void DivideTyped(const void* in, void* out,
                                         int64_t count, int64_t divisor) {
  if (IsPowerOfTwo(divisor)) {
    return DivideLoop<T>(in, out, count,
                         MultiplyBy<T>{T(1) / static_cast<T>(divisor)});
  }
  DivideLoop<T>(in, out, count, DivideBy<T>{static_cast<T>(divisor)});
}

}  // namespace

void ReduceInto(DataType dtype, ReduceOp op, const void* in, void* inout,
                int64_t count) {
  // Cannot fail without a divisor.
  ReducePair(dtype, op, inout, in, inout, count, /*divisor=*/1);
}

Status ReducePair(DataType dtype, ReduceOp op, const void* a, const void* b,
                  void* out, int64_t count, int64_t divisor) {
  if (divisor != 1) {
    if (divisor <= 0 || op != ReduceOp::kMean || !IsFloatingDataType(dtype)) {
      return Status::InvalidArgument(
          std::string("cannot reduce ") + DataTypeName(dtype) +
          " values and divide by " + std::to_string(divisor) +
          " (only a MEAN of a floating dtype divides, by a positive count)");
    }
  }
  switch (dtype) {
    case DataType::kUint8:
      ReduceTyped<uint8_t>(op, a, b, out, count, divisor);
      break;
    case DataType::kInt8:
      ReduceTyped<int8_t>(op, a, b, out, count, divisor);
      break;
    case DataType::kBool:
      ReduceBool(op, a, b, out, count);
      break;
    case DataType::kInt32:
      ReduceTyped<int32_t>(op, a, b, out, count, divisor);
      break;
    case DataType::kInt64:
      ReduceTyped<int64_t>(op, a, b, out, count, divisor);
      break;
    case DataType::kFloat16:
      Reduce16<HalfToFloat, FloatToHalf>(op, a, b, out, count, divisor);
      break;
    case DataType::kBFloat16:
      Reduce16<BFloat16ToFloat, FloatToBFloat16>(op, a, b, out, count,
                                                 divisor);
      break;
    case DataType::kFloat32:
      ReduceTyped<float>(op, a, b, out, count, divisor);
      break;
    case DataType::kFloat64:
      ReduceTyped<double>(op, a, b, out, count, divisor);
      break;
  }
  return Status::Ok();
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
