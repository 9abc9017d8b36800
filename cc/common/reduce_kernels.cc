#include "cc/common/reduce_kernels.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cc/common/float16.h"

namespace mpistrategy {

namespace {

template <typename T>
bool IsNan(T v) {
  if constexpr (std::is_floating_point<T>::value) return v != v;
  return false;
}

template <typename T>
T Combine(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      return static_cast<T>(a + b);
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      // A NaN wins, as in tf.minimum/tf.maximum (std::min/max would return
      // whichever operand comes first).
      if (IsNan(a)) return a;
      if (IsNan(b)) return b;
      return op == ReduceOp::kMin ? std::min(a, b) : std::max(a, b);
    case ReduceOp::kProduct:
      return static_cast<T>(a * b);
  }
  return a;
}

template <typename T>
void ReduceTyped(ReduceOp op, const void* in, void* inout, int64_t count) {
  const T* src = static_cast<const T*>(in);
  T* dst = static_cast<T*>(inout);
  switch (op) {
    // Separate loops so the compiler can vectorise the common cases.
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<T>(dst[i] + src[i]);
      return;
    default:
      for (int64_t i = 0; i < count; ++i) dst[i] = Combine(op, dst[i], src[i]);
      return;
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void Reduce16(ReduceOp op, const void* in, void* inout, int64_t count) {
  const uint16_t* src = static_cast<const uint16_t*>(in);
  uint16_t* dst = static_cast<uint16_t*>(inout);
  for (int64_t i = 0; i < count; ++i) {
    dst[i] = FromFloat(Combine(op, ToFloat(dst[i]), ToFloat(src[i])));
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

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void Divide16(void* data, int64_t count, int64_t divisor) {
  uint16_t* p = static_cast<uint16_t*>(data);
  const float d = static_cast<float>(divisor);
  for (int64_t i = 0; i < count; ++i) p[i] = FromFloat(ToFloat(p[i]) / d);
}

template <typename T>
void DivideTyped(void* data, int64_t count, int64_t divisor) {
  T* p = static_cast<T*>(data);
  const T d = static_cast<T>(divisor);
  for (int64_t i = 0; i < count; ++i) p[i] /= d;
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

Status DivideInPlace(DataType dtype, void* data, int64_t count,
                     int64_t divisor) {
  switch (dtype) {
    case DataType::kFloat16:
      Divide16<HalfToFloat, FloatToHalf>(data, count, divisor);
      return Status::Ok();
    case DataType::kBFloat16:
      Divide16<BFloat16ToFloat, FloatToBFloat16>(data, count, divisor);
      return Status::Ok();
    case DataType::kFloat32:
      DivideTyped<float>(data, count, divisor);
      return Status::Ok();
    case DataType::kFloat64:
      DivideTyped<double>(data, count, divisor);
      return Status::Ok();
    default:
      return Status::InvalidArgument(std::string("cannot divide ") +
                                     DataTypeName(dtype) +
                                     " values (mean needs a floating dtype)");
  }
}

}  // namespace mpistrategy
