// Shared by every ISA's quantized GEMM: how a group's integer dot product becomes fp32.
//
// With activations a = sa * qa (per row and group, scaled_sum = sa * sum(qa)) and packed weights u
// (INT8: u = q + 128, w = ws * q; INT4: u = q, w = ws * q + wm), one group contributes
//     sa * ws * D + scaled_sum * wm,   D = sum(qa * u),   wm = -128 * ws for INT8,
// so a single u8 x s8 dot product (AMX tdpbsud, AVX-512 vpdpbusd) serves both methods. (AMX INT8
// stages q itself and runs tdpbssd, which drops the INT8 offset term: amx/qgemm-inl.h.)
#pragma once

#include <cstdint>

#include "kt/float_types.h"
#include "kt/quant_types.h"

namespace kt::kernels {

// The methods whose packed groups these kernels decode: a method of another layout has its own
// kernels (src/methods/<method>/) and must never reach an INT8 / INT4 branch.
template <Method M>
inline constexpr bool kIntegerMethod = M == Method::kInt8 || M == Method::kInt4;

template <Method M>
struct GroupScales {
  // fp16 scale (and min) of channel n in the group's scale block.
  static float scale(const uint8_t* block, int n) {
    return fp16_to_float(reinterpret_cast<const uint16_t*>(block)[n]);
  }
  static float offset(const uint8_t* block, int n) {
    if constexpr (M == Method::kInt8) return -128.0f * scale(block, n);
    return fp16_to_float(reinterpret_cast<const uint16_t*>(block)[kPanelWidth + n]);
  }
};

// Packed byte u of channel n, K-value k (0 <= k < group) of one group's weight block.
template <Method M>
inline uint8_t packed_weight(const uint8_t* w, int group, int n, int k) {
  const int r = k / 4, j = k % 4;
  if constexpr (M == Method::kInt8) {
    return w[(r * kPanelWidth + n) * 4 + j];
  } else {
    const int half = group / 8;
    if (r < half) return w[(r * kPanelWidth + n) * 4 + j] & 0x0f;
    return w[((r - half) * kPanelWidth + n) * 4 + j] >> 4;
  }
}

}  // namespace kt::kernels
