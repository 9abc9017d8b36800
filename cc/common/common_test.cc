#include <cmath>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "cc/common/common.h"
#include "cc/common/float16.h"
#include "cc/common/reduce_kernels.h"
#include "cc/common/streaming_copy.h"
#include <gtest/gtest.h>

namespace mpistrategy {
namespace {

TEST(Common, NamesAndSizes) {
  EXPECT_EQ(DataTypeSize(DataType::kBFloat16), 2);
  EXPECT_EQ(DataTypeSize(DataType::kInt64), 8);
  EXPECT_STREQ(DataTypeName(DataType::kFloat16), "float16");
  EXPECT_STREQ(ReduceOpName(ReduceOp::kProduct), "product");
  EXPECT_STREQ(CollectiveTypeName(CollectiveType::kReducescatter),
               "reducescatter");
  EXPECT_EQ(ShapeString({2, 3}), "[2, 3]");
  EXPECT_EQ(ShapeString({}), "[]");
  EXPECT_EQ(NumElements({}), 1);
  EXPECT_EQ(NumElements({4, 0}), 0);
  EXPECT_EQ(Status::Aborted("x").ToString(), "ABORTED: x");
  EXPECT_EQ(Status::Ok().ToString(), "OK");
  EXPECT_EQ(FormatSeconds(61.4), "61");
  EXPECT_EQ(FormatSeconds(0.5), "0.5");
}

TEST(Common, PackedGroupLayoutOfOneDtypeIsOneAlignedSegment) {
  // float32 [3], [5], []: at 0, 64 (after 12 bytes) and 128 (after 84).
  const PackedLayout layout = PackedGroupLayout(
      {DataType::kFloat32, DataType::kFloat32, DataType::kFloat32},
      {{3}, {5}, {}});
  ASSERT_EQ(layout.segments.size(), 1u);
  EXPECT_EQ(layout.segments[0].byte_offset, 0);
  EXPECT_EQ(layout.segments[0].elements, 33);  // (128 + 4) / 4
  EXPECT_EQ(layout.byte_offsets, (std::vector<int64_t>{0, 64, 128}));
  EXPECT_EQ(layout.total_bytes, 132);
}

TEST(Common, PackedGroupLayoutGroupsByDtypeAndAligns) {
  // float32 [3], int8 [5], float32 [], float64 [0], int8 [70].
  const PackedLayout layout = PackedGroupLayout(
      {DataType::kFloat32, DataType::kInt8, DataType::kFloat32,
       DataType::kFloat64, DataType::kInt8},
      {{3}, {5}, {}, {0}, {70}});
  ASSERT_EQ(layout.segments.size(), 3u);
  // float32 segment: tensor 0 at 0 (12 bytes), tensor 2 at 64 (4 bytes).
  EXPECT_EQ(layout.segments[0].dtype, DataType::kFloat32);
  EXPECT_EQ(layout.segments[0].byte_offset, 0);
  EXPECT_EQ(layout.segments[0].elements, 17);  // (64 + 4) / 4
  // int8 segment at 128: tensor 1 (5 bytes), tensor 4 at 192 (70 bytes).
  EXPECT_EQ(layout.segments[1].dtype, DataType::kInt8);
  EXPECT_EQ(layout.segments[1].byte_offset, 128);
  EXPECT_EQ(layout.segments[1].elements, 64 + 70);
  // float64 segment at 320 (262 rounded up), empty.
  EXPECT_EQ(layout.segments[2].dtype, DataType::kFloat64);
  EXPECT_EQ(layout.segments[2].byte_offset, 320);
  EXPECT_EQ(layout.segments[2].elements, 0);
  EXPECT_EQ(layout.byte_offsets, (std::vector<int64_t>{0, 128, 64, 320, 192}));
  EXPECT_EQ(layout.total_bytes, 320);
  for (int64_t offset : layout.byte_offsets) {
    EXPECT_EQ(offset % kPackAlignmentBytes, 0);
  }
  EXPECT_EQ(PackedGroupLayout({}, {}).total_bytes, 0);
}

TEST(Float16, HalfRoundTripAndRounding) {
  // Every finite half round-trips exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = HalfToFloat(bits);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    ASSERT_EQ(FloatToHalf(f), bits) << "half bits " << h;
  }
  EXPECT_EQ(HalfToFloat(FloatToHalf(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(HalfToFloat(FloatToHalf(65520.0f))));
  EXPECT_EQ(HalfToFloat(FloatToHalf(65519.0f)), 65504.0f);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1).
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 2048)), 1.0f);
  // 1 + 3 * 2^-11 ties to 1 + 2^-9 (even mantissa).
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 3.0f / 2048)), 1.0f + 4.0f / 2048);
  // Subnormals: smallest is 2^-24; half of it ties to zero.
  EXPECT_EQ(HalfToFloat(FloatToHalf(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
}

TEST(Float16, BFloat16Rounding) {
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = BFloat16ToFloat(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBFloat16(f), bits);
  }
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even.
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(
      FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(ReduceKernels, BoolAndDivide) {
  uint8_t a[4] = {0, 1, 0, 1};
  uint8_t b[4] = {0, 0, 1, 1};
  uint8_t c[4];
  std::copy(b, b + 4, c);
  ReduceInto(DataType::kBool, ReduceOp::kSum, a, c, 4);
  EXPECT_EQ(c[0] + 2 * c[1] + 4 * c[2] + 8 * c[3], 14);
  std::copy(b, b + 4, c);
  ReduceInto(DataType::kBool, ReduceOp::kProduct, a, c, 4);
  EXPECT_EQ(c[0] + 2 * c[1] + 4 * c[2] + 8 * c[3], 8);
  float f[2] = {3, 9};
  EXPECT_TRUE(DivideInPlace(DataType::kFloat32, f, 2, 3).ok());
  EXPECT_EQ(f[1], 3.0f);
  int32_t i[1] = {3};
  EXPECT_EQ(DivideInPlace(DataType::kInt32, i, 1, 3).code(),
            StatusCode::kInvalidArgument);
}

// The vectorised ReduceInto is bit for bit the element-by-element
// definition for every op, whatever the length (vector blocks and the
// tail), the alignment and in place or not: integer sums and products wrap,
// min and max keep std::min/std::max's choice on ties (-0.0 against +0.0)
// and let a NaN win, inout's first.
template <typename T>
T ReferenceCombine(ReduceOp op, T a, T b) {
  using U = typename std::conditional<std::is_integral<T>::value,
                                      std::make_unsigned<T>,
                                      std::common_type<T>>::type::type;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      return static_cast<T>(static_cast<U>(static_cast<U>(a) +
                                           static_cast<U>(b)));
    case ReduceOp::kProduct:
      return static_cast<T>(static_cast<U>(static_cast<U>(a) *
                                           static_cast<U>(b)));
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      if (a != a) return a;
      if (b != b) return b;
      return op == ReduceOp::kMin ? std::min(a, b) : std::max(a, b);
  }
  return a;
}

// Bit for bit, except that arithmetic on two NaNs may give either one (the
// hardware and the compiler's operand order decide); min and max select, so
// their NaN is exact too.
template <typename T>
bool SameValue(ReduceOp op, T got, T want) {
  if (want != want && (op == ReduceOp::kSum || op == ReduceOp::kMean ||
                       op == ReduceOp::kProduct)) {
    return got != got;
  }
  return std::memcmp(&got, &want, sizeof(T)) == 0;
}

template <typename T>
void ExpectReduceIsElementwise(DataType dtype) {
  std::vector<T> values = {T(0), T(1), T(3), T(-2), T(7),
                           std::numeric_limits<T>::max(),
                           std::numeric_limits<T>::lowest(),
                           static_cast<T>(std::numeric_limits<T>::max() / 3)};
  if (std::is_floating_point<T>::value) {
    values.push_back(-T(0));
    values.push_back(T(0.5));
    values.push_back(std::numeric_limits<T>::infinity());
    values.push_back(-std::numeric_limits<T>::infinity());
    values.push_back(std::numeric_limits<T>::quiet_NaN());
    values.push_back(-std::numeric_limits<T>::quiet_NaN());
  }
  const int v = static_cast<int>(values.size());
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kProduct,
                      ReduceOp::kMin, ReduceOp::kMax}) {
    for (int64_t count : {0, 1, 3, 4, 31, 32, 33, 100, 1000}) {
      for (int offset : {0, 1}) {  // aligned and unaligned
        std::vector<T> a(offset + count), b(offset + count);
        for (int64_t i = 0; i < count; ++i) {
          a[offset + i] = values[i % v];
          b[offset + i] = values[(i / v + 3 * i) % v];  // every pair
        }
        std::vector<T> got = b;
        ReduceInto(dtype, op, a.data() + offset, got.data() + offset, count);
        std::vector<T> self = a;  // in place: in == inout
        ReduceInto(dtype, op, self.data() + offset, self.data() + offset,
                   count);
        for (int64_t i = 0; i < count; ++i) {
          const T want = ReferenceCombine(op, b[offset + i], a[offset + i]);
          const T want_self =
              ReferenceCombine(op, a[offset + i], a[offset + i]);
          ASSERT_TRUE(SameValue(op, got[offset + i], want))
              << DataTypeName(dtype) << " op " << static_cast<int>(op)
              << " element " << i << " of " << count << ": "
              << +b[offset + i] << ", " << +a[offset + i];
          ASSERT_TRUE(SameValue(op, self[offset + i], want_self))
              << DataTypeName(dtype) << " op " << static_cast<int>(op)
              << " in place, element " << i;
        }
      }
    }
  }
}

TEST(ReduceKernels, ReduceIsElementwiseForEveryOp) {
  ExpectReduceIsElementwise<uint8_t>(DataType::kUint8);
  ExpectReduceIsElementwise<int8_t>(DataType::kInt8);
  ExpectReduceIsElementwise<int32_t>(DataType::kInt32);
  ExpectReduceIsElementwise<int64_t>(DataType::kInt64);
  ExpectReduceIsElementwise<float>(DataType::kFloat32);
  ExpectReduceIsElementwise<double>(DataType::kFloat64);
}

// Divide (MEAN's division) is bit for bit the scalar division, whatever the
// divisor (power of two: multiplied by the reciprocal), the length (vector
// blocks and the tail), the alignment and in place or not.
template <typename T>
void ExpectDivideIsScalarDivision(DataType dtype) {
  const T denormal = std::numeric_limits<T>::denorm_min();
  std::vector<T> values = {T(0), -T(0), T(1), T(-3), T(1) / T(3), T(1e30),
                           std::numeric_limits<T>::max(),
                           std::numeric_limits<T>::min(), denormal,
                           T(3) * denormal,
                           std::numeric_limits<T>::infinity(),
                           -std::numeric_limits<T>::infinity(),
                           std::numeric_limits<T>::quiet_NaN()};
  for (int k = 0; k < 40; ++k) values.push_back(T(k) * T(0.7) - T(11));
  for (int64_t divisor : {1, 2, 3, 4, 6, 7, 8, 64, 1000}) {
    for (int64_t count : {0, 1, 7, 8, 9, 33, 53}) {
      for (int offset : {0, 1}) {  // aligned and unaligned
        std::vector<T> in(offset + count), out(offset + count, T(-1));
        for (int64_t i = 0; i < count; ++i) {
          in[offset + i] = values[i % values.size()];
        }
        std::vector<T> inplace = in;
        ASSERT_TRUE(Divide(dtype, in.data() + offset, out.data() + offset,
                           count, divisor)
                        .ok());
        ASSERT_TRUE(
            DivideInPlace(dtype, inplace.data() + offset, count, divisor)
                .ok());
        for (int64_t i = 0; i < count; ++i) {
          const T want = in[offset + i] / static_cast<T>(divisor);
          for (T got : {out[offset + i], inplace[offset + i]}) {
            if (std::isnan(want)) {
              EXPECT_TRUE(std::isnan(got));
            } else {
              EXPECT_EQ(std::memcmp(&got, &want, sizeof(T)), 0)
                  << in[offset + i] << " / " << divisor << " = " << want
                  << ", got " << got;
            }
          }
        }
      }
    }
  }
}

TEST(ReduceKernels, DivideIsExactlyTheScalarDivision) {
  ExpectDivideIsScalarDivision<float>(DataType::kFloat32);
  ExpectDivideIsScalarDivision<double>(DataType::kFloat64);
}

TEST(ReduceKernels, Divide16RoundsTheFloatQuotient) {
  std::vector<uint16_t> half, bf16;
  for (float v : {0.0f, 1.0f, -3.0f, 65504.0f, 1e-7f, 0.3333f, 1000.5f,
                  std::numeric_limits<float>::infinity(), std::nanf("")}) {
    half.push_back(FloatToHalf(v));
    bf16.push_back(FloatToBFloat16(v));
  }
  for (int64_t divisor : {2, 3, 8}) {
    std::vector<uint16_t> h(half.size()), b(bf16.size());
    ASSERT_TRUE(Divide(DataType::kFloat16, half.data(), h.data(), h.size(),
                       divisor)
                    .ok());
    ASSERT_TRUE(Divide(DataType::kBFloat16, bf16.data(), b.data(), b.size(),
                       divisor)
                    .ok());
    for (size_t i = 0; i < half.size(); ++i) {
      const float d = static_cast<float>(divisor);
      const float want_h = HalfToFloat(FloatToHalf(HalfToFloat(half[i]) / d));
      const float want_b =
          BFloat16ToFloat(FloatToBFloat16(BFloat16ToFloat(bf16[i]) / d));
      if (std::isnan(want_h)) {
        EXPECT_TRUE(std::isnan(HalfToFloat(h[i])));
        EXPECT_TRUE(std::isnan(BFloat16ToFloat(b[i])));
        continue;
      }
      EXPECT_EQ(HalfToFloat(h[i]), want_h) << i << " / " << divisor;
      EXPECT_EQ(BFloat16ToFloat(b[i]), want_b) << i << " / " << divisor;
    }
  }
  float f[1] = {1};
  EXPECT_EQ(DivideInPlace(DataType::kFloat32, f, 1, 0).code(),
            StatusCode::kInvalidArgument);
}

// ReducePair is ReduceInto followed, for a MEAN, by Divide, bit for bit, for
// every dtype, op, divisor, length and alignment, with `out` separate or
// either input; a divisor other than 1 is refused where no MEAN divides.
template <typename T>
void ExpectReducePairIsReduceThenDivide(DataType dtype,
                                        const std::vector<T>& values) {
  const int v = static_cast<int>(values.size());
  const bool floating = IsFloatingDataType(dtype);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kProduct,
                      ReduceOp::kMin, ReduceOp::kMax}) {
    for (int64_t divisor : {1, 2, 3, 4, 7}) {
      const bool divides = divisor > 1 && op == ReduceOp::kMean && floating;
      for (int64_t count : {0, 1, 15, 16, 17, 100}) {
        for (int offset : {0, 1}) {
          std::vector<T> a(offset + count), b(offset + count);
          for (int64_t i = 0; i < count; ++i) {
            a[offset + i] = values[i % v];
            b[offset + i] = values[(i / v + 3 * i) % v];
          }
          T* pa = a.data() + offset;
          T* pb = b.data() + offset;
          std::vector<T> want = a;  // op(a, b): a is inout's side
          ReduceInto(dtype, op, pb, want.data() + offset, count);
          if (divides) {
            ASSERT_TRUE(DivideInPlace(dtype, want.data() + offset, count,
                                      divisor)
                            .ok());
          }
          std::vector<T> out(offset + count), into_a = a, into_b = b;
          const Status s = ReducePair(dtype, op, pa, pb, out.data() + offset,
                                      count, divisor);
          if (divisor > 1 && !divides) {
            EXPECT_EQ(s.code(), StatusCode::kInvalidArgument)
                << DataTypeName(dtype) << " op " << static_cast<int>(op);
            continue;
          }
          ASSERT_TRUE(s.ok()) << s.message();
          ASSERT_TRUE(ReducePair(dtype, op, into_a.data() + offset, pb,
                                 into_a.data() + offset, count, divisor)
                          .ok());
          ASSERT_TRUE(ReducePair(dtype, op, pa, into_b.data() + offset,
                                 into_b.data() + offset, count, divisor)
                          .ok());
          for (int64_t i = 0; i < count; ++i) {
            for (const std::vector<T>* got : {&out, &into_a, &into_b}) {
              ASSERT_TRUE(
                  SameValue(op, (*got)[offset + i], want[offset + i]))
                  << DataTypeName(dtype) << " op " << static_cast<int>(op)
                  << " / " << divisor << ", element " << i << " of "
                  << count;
            }
          }
        }
      }
    }
  }
}

TEST(ReduceKernels, ReducePairIsReduceThenDivide) {
  const std::vector<double> reals = {
      0.0, -0.0, 1.0, -3.0, 1.0 / 3.0, 0.7, 7.0, 1e30, -11.3, 5e-324,
      std::numeric_limits<double>::infinity(), std::nan("")};
  std::vector<float> f;
  std::vector<double> d;
  std::vector<uint16_t> h, bf;
  for (double x : reals) {
    f.push_back(static_cast<float>(x));
    d.push_back(x);
    h.push_back(FloatToHalf(static_cast<float>(x)));
    bf.push_back(FloatToBFloat16(static_cast<float>(x)));
  }
  ExpectReducePairIsReduceThenDivide<float>(DataType::kFloat32, f);
  ExpectReducePairIsReduceThenDivide<double>(DataType::kFloat64, d);
  ExpectReducePairIsReduceThenDivide<int32_t>(
      DataType::kInt32, {0, 1, -7, 3, std::numeric_limits<int32_t>::max(),
                         std::numeric_limits<int32_t>::min()});
  ExpectReducePairIsReduceThenDivide<int64_t>(DataType::kInt64,
                                              {0, 1, -7, 1LL << 62});
  ExpectReducePairIsReduceThenDivide<uint8_t>(DataType::kUint8,
                                              {0, 1, 200, 255});
  ExpectReducePairIsReduceThenDivide<int8_t>(DataType::kInt8,
                                             {0, 1, -128, 127});
  ExpectReducePairIsReduceThenDivide<uint8_t>(DataType::kBool, {0, 1});
}

// The same for 16-bit floats, compared as bits (their NaNs come from the
// float conversion, the same in both).
TEST(ReduceKernels, ReducePairOf16BitFloatsRoundsTheSumThenTheQuotient) {
  for (DataType dtype : {DataType::kFloat16, DataType::kBFloat16}) {
    const bool half = dtype == DataType::kFloat16;
    std::vector<uint16_t> a, b;
    for (float x : {0.0f, 1.0f, -3.0f, 65504.0f, 1e-7f, 0.3333f, 1000.5f,
                    2049.0f, std::numeric_limits<float>::infinity()}) {
      for (float y : {1.0f, 0.001f, -2.5f, 65504.0f, 3.0f}) {
        a.push_back(half ? FloatToHalf(x) : FloatToBFloat16(x));
        b.push_back(half ? FloatToHalf(y) : FloatToBFloat16(y));
      }
    }
    for (int64_t divisor : {1, 2, 3, 8}) {
      std::vector<uint16_t> want = a, got(a.size());
      ReduceInto(dtype, ReduceOp::kMean, b.data(), want.data(), want.size());
      ASSERT_TRUE(
          DivideInPlace(dtype, want.data(), want.size(), divisor).ok());
      ASSERT_TRUE(ReducePair(dtype, ReduceOp::kMean, a.data(), b.data(),
                             got.data(), got.size(), divisor)
                      .ok());
      EXPECT_EQ(got, want) << DataTypeName(dtype) << " / " << divisor;
    }
  }
}

TEST(ReduceKernels, MinMaxPropagateNanAndInt8Wraps) {
  const float nan = std::nanf("");
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    // NaN on either side, in a loop long enough to be vectorised.
    std::vector<float> a(64, 1.0f), b(64, 2.0f);
    a[3] = nan;
    b[40] = nan;
    ReduceInto(DataType::kFloat32, op, a.data(), b.data(), 64);
    EXPECT_TRUE(std::isnan(b[3])) << ReduceOpName(op);
    EXPECT_TRUE(std::isnan(b[40])) << ReduceOpName(op);
    EXPECT_EQ(b[0], op == ReduceOp::kMin ? 1.0f : 2.0f);
    double x[1] = {nan}, y[1] = {-1.0};
    ReduceInto(DataType::kFloat64, op, y, x, 1);
    EXPECT_TRUE(std::isnan(x[0]));
  }
  std::vector<int8_t> p(64, 100), q(64, 100);
  ReduceInto(DataType::kInt8, ReduceOp::kSum, p.data(), q.data(), 64);
  EXPECT_EQ(q[63], -56);  // wraps like numpy and TF
  std::vector<uint8_t> u(64, 200), v(64, 200);
  ReduceInto(DataType::kUint8, ReduceOp::kSum, u.data(), v.data(), 64);
  EXPECT_EQ(v[0], 144);
}

// Every size around the streaming threshold and every misalignment of either
// side: the bytes arrive as memcpy's would, and nothing outside the
// destination range is written.
TEST(StreamingCopy, CopiesLikeMemcpy) {
  const std::vector<int64_t> sizes = {
      0, 1, 15, 63, kMinStreamingCopyBytes - 1, kMinStreamingCopyBytes,
      kMinStreamingCopyBytes + 1, kMinStreamingCopyBytes + 63, 3 << 20};
  std::vector<char> src((3 << 20) + 128);
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<char>(i * 131 + 7);
  }
  for (int64_t bytes : sizes) {
    for (int src_offset : {0, 1, 16, 33}) {
      for (int dst_offset : {0, 3, 16, 47}) {
        std::vector<char> dst(bytes + 128, '#');
        StreamingCopy(dst.data() + dst_offset, src.data() + src_offset, bytes);
        ASSERT_EQ(std::memcmp(dst.data() + dst_offset,
                              src.data() + src_offset, bytes),
                  0)
            << bytes << " bytes, offsets " << src_offset << "/" << dst_offset;
        for (int64_t i = 0; i < dst_offset; ++i) ASSERT_EQ(dst[i], '#');
        for (int64_t i = dst_offset + bytes; i < bytes + 128; ++i) {
          ASSERT_EQ(dst[i], '#') << bytes << " bytes, byte " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace mpistrategy
