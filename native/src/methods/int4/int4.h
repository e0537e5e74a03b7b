// AMXINT4: int4 weights with an fp16 scale and min per group of K, quantized by the engine
// (asymmetric, w = ws * q + min). Packed as INT4's nibbles (quant_types.h) followed by the 16
// scales and the 16 mins.
#pragma once

#include <cstdint>

#include "kernels/epilogue.h"
#include "kt/quant_types.h"

namespace kt {

struct Int4Decoder {
  static constexpr Method kMethod = Method::kInt4;
  using Codes = kernels::IntNibbles;
  template <class L>
  static kernels::ScalePair<L> scales(const uint8_t* block, int n0) {
    return {L::fp16(block + 2 * n0), L::fp16(block + 2 * kPanelWidth + 2 * n0)};
  }
};

}  // namespace kt
