// MXFP4: float4 e2m1 weights with an e8m0 scale per 32 K-values, as gpt-oss and DeepSeek-V4-Flash
// ship them. The codes pack into INT4's nibble layout (quant_types.h) with the group's 16 scale
// bytes after them; the integer A16 kernels look each code up as twice its e2m1 value (an integer
// in -12..12) and take half the scale, so the products are exact and only the activations round.
#pragma once

#include <cstdint>

#include "kt/kernels.h"
#include "kt/packing.h"
#include "kt/quantize.h"

namespace kt::mxfp4 {

// Group `gi` of the panel whose first channel is packed row n0, into `dst` (group_bytes long).
void pack_group(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi, uint8_t* dst);

}  // namespace kt::mxfp4

namespace kt::kernels {
// The A16 GEMM per family (src/methods/mxfp4/<isa>.cpp); AMX takes AVX-512's.
#define KT_DECLARE_MXFP4(ns)                                                                          \
  namespace ns {                                                                                      \
  void gemm_mxfp4(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, \
                  float* c, int64_t ldc);                                                             \
  }
KT_DECLARE_MXFP4(scalar)
KT_DECLARE_MXFP4(avx2)
KT_DECLARE_MXFP4(avx512)
#undef KT_DECLARE_MXFP4
}  // namespace kt::kernels
