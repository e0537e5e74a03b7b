// One weight of a packed group as a float, for every method: the portable decode that the
// fine-tuning backward uses to read the packed panels transposed (scalar/lora_ops.cpp). The GEMMs
// never call it.
#pragma once

#include <cstdint>

#include "../methods/decoders.h"
#include "../methods/fp8/fp8.h"
#include "epilogue.h"
#include "kt/float_types.h"
#include "scalar/lanes.h"

namespace kt::kernels {

// W[n][k] of channel n (0..15), K-value k (0 <= k < group) of the group block `g` (quant_types.h).
template <Method M>
inline float packed_value(const uint8_t* g, int group, int n, int k) {
  if constexpr (M == Method::kBf16) {
    return bf16_to_float(reinterpret_cast<const uint16_t*>(g)[((k / 2) * kPanelWidth + n) * 2 + k % 2]);
  } else if constexpr (M == Method::kFp8 || M == Method::kFp8PerChannel) {
    const float scale = reinterpret_cast<const float*>(g + group_weight_bytes(M, group))[n];
    return scale * e4m3_to_float(g[fp8::packed_offset(k / 2, n, k % 2)]);
  } else {
    using D = typename DecoderFor<M>::type;
    using C = typename D::Codes;
    const auto [scale, offset] = D::template scales<scalar::Lanes>(g + group_weight_bytes(M, group), n);
    const float q = static_cast<float>(code_value<C>(packed_code<C>(g, group, n, k)));
    return scale * q + value_offset<C>(offset);
  }
}

}  // namespace kt::kernels
