// NVFP4: float4 e2m1 weights with an e4m3 scale per 16 K-values and one fp32 scale per matrix, as
// ModelOpt and compressed-tensors checkpoints ship them. The codes pack into INT4's nibble layout
// (quant_types.h), each group followed by its 16 e4m3 scale bytes and the matrix scale; the integer
// A16 kernels look the codes up as twice their value (exact) and take half of scale * global.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/epilogue.h"
#include "kt/kernels.h"
#include "kt/packing.h"
#include "kt/quantize.h"

namespace kt::nvfp4 {

// Group `gi` of the panel whose first channel is packed row n0, into `dst` (group_bytes long).
void pack_group(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi, uint8_t* dst);

}  // namespace kt::nvfp4

namespace kt {

// w = e4m3 scale * global * e2m1, the matrix's fp32 global stored after each group's 16 scales;
// the codes are looked up as twice their value, so the scale is halved.
struct Nvfp4Decoder {
  static constexpr Method kMethod = Method::kNvfp4;
  using Codes = kernels::E2m1Nibbles;
  static constexpr bool kMatrixScale = true;
  static float matrix_scale(const uint8_t* block) {
    float g;
    std::memcpy(&g, block + kPanelWidth, 4);
    return g;
  }
  template <class L>
  static typename L::F block_scales(const uint8_t* block, int n0) {
    return L::e4m3(block + n0);
  }
  template <class L>
  static kernels::ScalePair<L> scales(const uint8_t* block, int n0) {
    return {L::mul(block_scales<L>(block, n0), L::set1(0.5f * matrix_scale(block))), L::zero()};
  }
};

}  // namespace kt
