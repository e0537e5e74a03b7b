// RAWINT4 and GPTQ_INT4: int4 checkpoints computed with their own values. Both repack into INT4's
// nibble layout (quant_types.h), keeping each checkpoint's own scale block:
//   RAWINT4 (compressed-tensors pack-quantized, Kimi-K2): bf16 scale per group; w = s * (q - 8)
//   GPTQ_INT4: fp16 scale and an integer zero per group, packed as fp16 -zero; w = s * (q - zero)
// so the integer A16 kernels (src/kernels/<isa>/qgemm_a16-inl.h) serve them through the epilogue
// of src/kernels/epilogue.h, with nothing rounded but the activations (bf16, requantized to int16).
#pragma once

#include <cstdint>

#include "kt/kernels.h"
#include "kt/packing.h"
#include "kt/quantize.h"

namespace kt::int4_checkpoint {

// Group `gi` of the panel whose first channel is packed row n0, into `dst` (group_bytes long).
void pack_group_rawint4(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                        uint8_t* dst);
void pack_group_gptq(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                     uint8_t* dst);

}  // namespace kt::int4_checkpoint

namespace kt::kernels {
// Per family (src/methods/int4_checkpoint/<isa>.cpp); AMX takes AVX-512's.
#define KT_DECLARE_INT4_CHECKPOINT(ns)                                                                  \
  namespace ns {                                                                                        \
  void gemm_rawint4(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, \
                    float* c, int64_t ldc);                                                             \
  void gemm_gptq(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,    \
                 float* c, int64_t ldc);                                                                \
  }
KT_DECLARE_INT4_CHECKPOINT(scalar)
KT_DECLARE_INT4_CHECKPOINT(avx2)
KT_DECLARE_INT4_CHECKPOINT(avx512)
#undef KT_DECLARE_INT4_CHECKPOINT
}  // namespace kt::kernels
