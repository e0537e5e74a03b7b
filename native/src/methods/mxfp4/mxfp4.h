// MXFP4: float4 e2m1 weights with an e8m0 scale per 32 K-values, as gpt-oss and DeepSeek-V4-Flash
// ship them. The codes pack into INT4's nibble layout (quant_types.h) with the group's 16 scale
// bytes after them; the integer A16 kernels look each code up as twice its e2m1 value (an integer
// in -12..12) and take half the scale, so the products are exact and only the activations round.
#pragma once

#include <cstdint>

#include "kernels/epilogue.h"
#include "kt/kernels.h"
#include "kt/packing.h"
#include "kt/quantize.h"

namespace kt::mxfp4 {

// Group `gi` of the panel whose first channel is packed row n0, into `dst` (group_bytes long).
void pack_group(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi, uint8_t* dst);

}  // namespace kt::mxfp4

namespace kt {

// w = 2^(e - 127) * e2m1: the codes are looked up as twice their value, so the scale is halved.
struct Mxfp4Decoder {
  static constexpr Method kMethod = Method::kMxfp4;
  using Codes = kernels::E2m1Nibbles;
  static constexpr bool kMatrixScale = false;
  template <class L>
  static typename L::F block_scales(const uint8_t* block, int n0) {
    return L::e8m0(block + n0);
  }
  template <class L>
  static kernels::ScalePair<L> scales(const uint8_t* block, int n0) {
    return {L::mul(block_scales<L>(block, n0), L::set1(0.5f)), L::zero()};
  }
};

}  // namespace kt
