// RAWINT4 and GPTQ_INT4: int4 checkpoints computed with their own values. Both repack into INT4's
// nibble layout (quant_types.h), keeping each checkpoint's own scale block:
//   RAWINT4 (compressed-tensors pack-quantized, Kimi-K2): bf16 scale per group; w = s * (q - 8)
//   GPTQ_INT4: fp16 scale and an integer zero per group, packed as fp16 -zero; w = s * (q - zero)
// so the integer A16 kernels (src/kernels/<isa>/qgemm_a16-inl.h) serve them through the epilogue
// of src/kernels/epilogue.h, with nothing rounded but the activations (bf16, requantized to int16).
#pragma once

#include <cstdint>

#include "kernels/epilogue.h"
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

namespace kt {

// RAWINT4: w = ws * (q - 8), the bf16 scale per group.
struct RawInt4Decoder {
  static constexpr Method kMethod = Method::kRawInt4;
  using Codes = kernels::IntNibbles;
  template <class L>
  static typename L::F zero_points(const uint8_t*, int) {
    return L::set1(-float{method_traits(kMethod).weight_zero});
  }
  template <class L>
  static kernels::ScalePair<L> scales(const uint8_t* block, int n0) {
    const auto ws = L::bf16(block + 2 * n0);
    return {ws, L::mul(ws, zero_points<L>(block, n0))};
  }
};

// GPTQ_INT4: w = ws * (q - zero), the fp16 scale then the fp16 -zero per channel.
struct GptqInt4Decoder {
  static constexpr Method kMethod = Method::kGptqInt4;
  using Codes = kernels::IntNibbles;
  template <class L>
  static typename L::F zero_points(const uint8_t* block, int n0) {
    return L::fp16(block + 2 * kPanelWidth + 2 * n0);
  }
  template <class L>
  static kernels::ScalePair<L> scales(const uint8_t* block, int n0) {
    const auto ws = L::fp16(block + 2 * n0);
    return {ws, L::mul(ws, zero_points<L>(block, n0))};
  }
};

}  // namespace kt
