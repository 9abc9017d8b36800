// IEEE float16 and bfloat16 <-> float32 conversions (round to nearest even).
//
// Used by the host reduction kernels (reduce_kernels.h), the MPI transport's
// user-defined MPI_Ops and the tests.  Header-only, no dependencies.

#ifndef MPISTRATEGY_CC_COMMON_FLOAT16_H_
#define MPISTRATEGY_CC_COMMON_FLOAT16_H_

#include <cstdint>
#include <cstring>

namespace mpistrategy {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// float32 -> float16 bits, round to nearest even; NaN stays (quiet) NaN,
// overflow becomes +-inf, tiny values become float16 subnormals or zero.
inline uint16_t FloatToHalf(float value) {
  uint32_t x = FloatBits(value);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t out;
  if (x >= (127u + 16u) << 23) {
    // |value| >= 65536, inf or NaN.
    out = x > (255u << 23) ? 0x7e00u : 0x7c00u;
  } else if (x < (113u << 23)) {
    // Below the smallest normal float16 (2^-14): let the FPU do the
    // rounding by adding a magic number that aligns the float16 subnormal
    // ulp (2^-24) with the last mantissa bit of the float32 sum.
    const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    const float sum = BitsToFloat(x) + BitsToFloat(magic);
    out = FloatBits(sum) - magic;
  } else {
    const uint32_t mantissa_odd = (x >> 13) & 1u;
    // Rebias the exponent and add the rounding bias; a carry out of the
    // mantissa correctly bumps the exponent (up to infinity).
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;
    out = x >> 13;
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float32.
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return BitsToFloat(FloatBits(magnitude) | sign);
  }
  if (exponent == 31) {
    return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  }
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float32 -> bfloat16 bits, round to nearest even; NaN stays quiet NaN.
inline uint16_t FloatToBFloat16(float value) {
  const uint32_t x = FloatBits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x40u);
  }
  const uint32_t rounding_bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding_bias) >> 16);
}

inline float BFloat16ToFloat(uint16_t b) {
  return BitsToFloat(static_cast<uint32_t>(b) << 16);
}

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_COMMON_FLOAT16_H_
