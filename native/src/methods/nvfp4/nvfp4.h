// NVFP4: float4 e2m1 weights with an e4m3 scale per 16 K-values and one fp32 scale per matrix, as
// ModelOpt and compressed-tensors checkpoints ship them. The codes pack into INT4's nibble layout
// (quant_types.h), each group followed by its 16 e4m3 scale bytes and the matrix scale; the integer
// A16 kernels look the codes up as twice their value (exact) and take half of scale * global.
#pragma once

#include <cstdint>

#include "kt/kernels.h"
#include "kt/packing.h"
#include "kt/quantize.h"

namespace kt::nvfp4 {

// Group `gi` of the panel whose first channel is packed row n0, into `dst` (group_bytes long).
void pack_group(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi, uint8_t* dst);

}  // namespace kt::nvfp4

namespace kt::kernels {
// The A16 GEMM per family (src/methods/nvfp4/<isa>.cpp); AMX takes AVX-512's.
#define KT_DECLARE_NVFP4(ns)                                                                          \
  namespace ns {                                                                                      \
  void gemm_nvfp4(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, \
                  float* c, int64_t ldc);                                                             \
  }
KT_DECLARE_NVFP4(scalar)
KT_DECLARE_NVFP4(avx2)
KT_DECLARE_NVFP4(avx512)
#undef KT_DECLARE_NVFP4
}  // namespace kt::kernels
