// Shared by every ISA's quantized GEMM: how a group's integer dot product becomes fp32.
//
// With activations a = sa * qa (per row and group, scaled_sum = sa * sum(qa)) and packed weights u
// (INT8: u = q + 128, w = ws * q; INT4: u = q, w = ws * q + wm), one group contributes
//     sa * ws * D + scaled_sum * wm,   D = sum(qa * u),   wm = -128 * ws for INT8,
// so a single u8 x s8 dot product (AMX tdpbsud, AVX-512 vpdpbusd) serves every integer method; the
// checkpoint formats decode to INT4's form: RAWINT4 wm = -8 * ws, GPTQ_INT4 wm = -zero * ws. (AMX INT8
// stages q itself and runs tdpbssd, which drops the INT8 offset term: amx/qgemm-inl.h.)
#pragma once

#include <cstdint>
#include <cstring>

#include "kt/float_types.h"
#include "kt/quant_types.h"

namespace kt::kernels {

// The methods whose packed groups these kernels decode: a method of another layout has its own
// kernels (src/methods/<method>/) and must never reach an integer branch.
template <Method M>
inline constexpr bool kIntegerMethod = M == Method::kInt8 || M == Method::kInt4 || M == Method::kRawInt4 ||
                                       M == Method::kGptqInt4 || M == Method::kMxfp4 || M == Method::kNvfp4;
// Whether a method's packed weights are INT4's nibbles (else INT8's bytes).
template <Method M>
inline constexpr bool kNibbles = kIntegerMethod<M> && method_traits(M).weight_bits == 4;
// Whether its nibbles are codes looked up in a table (kE2m1Twice) rather than integers. Twice the
// e2m1 values are the integers -12..12, so these methods run the integer A16 kernels exactly, with
// half the scale.
template <Method M>
inline constexpr bool kLookupNibbles = kNibbles<M> && method_traits(M).weight_codes != nullptr;

// NVFP4's matrix scale, stored after each group's 16 channel scales.
inline float nvfp4_global(const uint8_t* block) {
  float g;
  std::memcpy(&g, block + kPanelWidth, 4);
  return g;
}
inline constexpr int8_t kE2m1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Each integer method's scale block (quant_types.h) as the scale ws and offset wm of the epilogue.
template <Method M>
struct GroupScales {
  static_assert(kIntegerMethod<M>);
  static float scale(const uint8_t* block, int n) {
    if constexpr (M == Method::kMxfp4) return 0.5f * e8m0_to_float(block[n]);  // weights are 2 x e2m1
    if constexpr (M == Method::kNvfp4) return 0.5f * e4m3_to_float(block[n]) * nvfp4_global(block);
    const uint16_t bits = reinterpret_cast<const uint16_t*>(block)[n];
    if constexpr (M == Method::kRawInt4) return bf16_to_float(bits);
    return fp16_to_float(bits);
  }
  static float offset(const uint8_t* block, int n) {
    if constexpr (M == Method::kMxfp4 || M == Method::kNvfp4) return 0.0f;
    if constexpr (M == Method::kInt8) return -128.0f * scale(block, n);
    if constexpr (M == Method::kRawInt4) return -float{method_traits(M).weight_zero} * scale(block, n);
    const float second = fp16_to_float(reinterpret_cast<const uint16_t*>(block)[kPanelWidth + n]);
    if constexpr (M == Method::kGptqInt4) return scale(block, n) * second;  // second = -zero
    return second;
  }
};

// The signed weight a packed byte u stands for: INT8's q = u - 128, the nibbles' u, or its code's
// value.
template <Method M>
inline int weight_value(uint8_t u) {
  if constexpr (kLookupNibbles<M>) return kE2m1Twice[u];
  if constexpr (kNibbles<M>) return u;
  return int{u} - 128;
}

// Packed byte u of channel n, K-value k (0 <= k < group) of one group's weight block.
template <Method M>
inline uint8_t packed_weight(const uint8_t* w, int group, int n, int k) {
  const int r = k / 4, j = k % 4;
  if constexpr (!kNibbles<M>) {
    return w[(r * kPanelWidth + n) * 4 + j];
  } else {
    const int half = group / 8;
    if (r < half) return w[(r * kPanelWidth + n) * 4 + j] & 0x0f;
    return w[((r - half) * kPanelWidth + n) * 4 + j] >> 4;
  }
}

}  // namespace kt::kernels
