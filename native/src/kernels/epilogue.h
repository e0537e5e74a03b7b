// Shared by every ISA's quantized GEMM: what a method's decoder gives the kernels, and how a
// group's integer dot product becomes fp32.
//
// With activations a = sa * qa (per row and group, scaled_sum = sa * sum(qa)) and packed weights u
// (INT8: u = q + 128, w = ws * q; INT4: u = q, w = ws * q + wm), one group contributes
//     sa * ws * D + scaled_sum * wm,   D = sum(qa * u),   wm = -128 * ws for INT8,
// so a single u8 x s8 dot product (AMX tdpbsud, AVX-512 vpdpbusd) serves every integer method; the
// checkpoint formats decode to INT4's form: RAWINT4 wm = -8 * ws, GPTQ_INT4 wm = -zero * ws. (AMX INT8
// stages q itself and runs tdpbssd, which drops the INT8 offset term: amx/qgemm-inl.h.)
//
// A decoder (src/methods/<method>/<method>.h, listed in src/methods/decoders.h) is a struct with
//   kMethod  its row of kMethodTable (packed bytes per group, activations it reads);
//   kCodes   what its packed weights are (Codes below);
//   template <class L> std::pair<L::F, L::F> scales(block, n0): the scale ws and offset wm of
//            channels n0 .. n0 + L::kCount - 1 of one group, from the group's scale block, where L
//            is an ISA's lanes (<isa>/lanes.h: 1, 8 or 16 fp32 values and the loads of each scale
//            type), so one definition serves every kernel family;
// and, for the nibble methods that read bf16 activations, what their decoded prefill
// (avx512/decoded_prefill-inl.h) needs: the e2m1 ones `block_scales<L>` (the part of the scale
// exact in bf16) with `kMatrixScale` / `matrix_scale(block)`, the integer ones `zero_points<L>`
// (-zero, so that w = ws * (q + zero_points)).
#pragma once

#include <cstdint>
#include <utility>

#include "kt/quant_types.h"

namespace kt::kernels {

// What a decoder's packed weight values are.
enum class Codes {
  kOffsetBytes,  // one byte a weight, u = q + 128 (INT8)
  kIntNibbles,   // INT4's nibble layout, the integer q = u
  kE2m1Nibbles,  // INT4's nibble layout, e2m1 codes (the FP4 methods)
};
// Whether a decoder's packed weights are INT4's nibbles (else INT8's bytes).
template <class D>
inline constexpr bool kNibbles = D::kCodes != Codes::kOffsetBytes;
// Whether its nibbles are codes looked up in a table (kE2m1Twice) rather than integers. Twice the
// e2m1 values are the integers -12..12, so these methods run the integer A16 kernels exactly, with
// half the scale.
template <class D>
inline constexpr bool kLookupNibbles = D::kCodes == Codes::kE2m1Nibbles;
inline constexpr int8_t kE2m1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// A group's scales ws and offsets wm in an ISA's lanes L.
template <class L>
using ScalePair = std::pair<typename L::F, typename L::F>;

// The signed weight a packed byte u stands for: INT8's q = u - 128, the nibbles' u, or its code's
// value.
template <class D>
inline int weight_value(uint8_t u) {
  if constexpr (kLookupNibbles<D>) return kE2m1Twice[u];
  if constexpr (kNibbles<D>) return u;
  return int{u} - 128;
}

// Packed byte u of channel n, K-value k (0 <= k < group) of one group's weight block.
template <class D>
inline uint8_t packed_weight(const uint8_t* w, int group, int n, int k) {
  const int r = k / 4, j = k % 4;
  if constexpr (!kNibbles<D>) {
    return w[(r * kPanelWidth + n) * 4 + j];
  } else {
    const int half = group / 8;
    if (r < half) return w[(r * kPanelWidth + n) * 4 + j] & 0x0f;
    return w[((r - half) * kPanelWidth + n) * 4 + j] >> 4;
  }
}

}  // namespace kt::kernels
