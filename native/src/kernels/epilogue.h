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
//   Codes    the code layout of its packed weights (codes.h: their bit width, the value of each
//            code, and their lane operations in each kernel family);
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

#include "codes.h"
#include "kt/quant_types.h"

namespace kt::kernels {

// A group's scales ws and offsets wm in an ISA's lanes L.
template <class L>
using ScalePair = std::pair<typename L::F, typename L::F>;

}  // namespace kt::kernels
