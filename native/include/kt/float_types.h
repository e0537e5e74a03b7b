// bf16 / fp16 <-> fp32 conversions shared by every ISA (the scalar twins of the SIMD converts).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kt {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// An e8m0 scale byte (MX formats) as 2^(e - 127); 0 reads as 0 (2^-127 is below every weight's
// precision) and 255, its NaN, is refused when weights are packed. The SIMD kernels shift it the same.
inline float e8m0_to_float(uint8_t e) {
  uint32_t u = static_cast<uint32_t>(e) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// e4m3fn (no infinities; S.1111.111 is NaN) to float, exact.
inline bool e4m3_is_nan(uint8_t bits) {
  return (bits & 0x7f) == 0x7f;
}
inline float e4m3_to_float(uint8_t bits) {
  const int exp = (bits >> 3) & 0xf, man = bits & 0x7;
  if (e4m3_is_nan(bits)) return std::nanf("");
  const float mag = exp == 0 ? std::ldexp(static_cast<float>(man), -9)
                             : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
  return bits & 0x80 ? -mag : mag;
}

// Round to nearest even, NaN kept quiet.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
    return sign ? -f : f;
  }
  uint32_t u = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; overflow saturates to infinity as IEEE conversion does.
inline uint16_t float_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (abs < 0x38800000u) {                                               // subnormal or zero in fp16
    const float a = std::fabs(f) * 16777216.0f;                          // units of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a)));
  }
  uint32_t v = abs - (112u << 23);
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
}

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline float load_as_float(const void* base, DType dt, int64_t i) {
  switch (dt) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[i];
    case DType::kFloat16:
      return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

}  // namespace kt
