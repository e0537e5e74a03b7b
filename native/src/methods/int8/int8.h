// AMXINT8: int8 weights with an fp16 scale per group of K, quantized by the engine. Packed as
// u = q + 128 (quant_types.h), so w = ws * u - 128 * ws.
#pragma once

#include <cstdint>

#include "kernels/epilogue.h"
#include "kt/quant_types.h"

namespace kt {

struct Int8Decoder {
  static constexpr Method kMethod = Method::kInt8;
  using Codes = kernels::OffsetBytes;
  template <class L>
  static kernels::ScalePair<L> scales(const uint8_t* block, int n0) {
    const auto ws = L::fp16(block + 2 * n0);
    return {ws, L::mul(ws, L::set1(-128.0f))};
  }
};

}  // namespace kt
