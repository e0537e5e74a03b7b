// Where the kernels find activation K-values (see Bf16Rows / QuantRows in kt/kernels.h).
#pragma once

#include <cstdint>

#include "kt/float_types.h"
#include "kt/kernels.h"

namespace kt::kernels {

inline const int8_t* quant_at(const QuantRows& a, int i, int64_t k) {
  return a.rows[i] + (k / kChunkBytes) * a.chunk_stride + k % kChunkBytes;
}

inline const uint16_t* bf16_at(const Bf16Rows& a, int i, int64_t k) {
  const auto* row = reinterpret_cast<const uint8_t*>(a.rows[i]);
  return reinterpret_cast<const uint16_t*>(row + (k / 32) * a.chunk_stride) + k % 32;
}

// Row i of `a` as fp32 (out[K]) and its sum per group (group_sums[K / group]).
inline void bf16_row_to_float(const Bf16Rows& a, int i, int64_t K, int group, float* out, float* group_sums) {
  for (int64_t k = 0; k < K; k += 32) {
    const uint16_t* chunk = bf16_at(a, i, k);
    for (int j = 0; j < 32; ++j) out[k + j] = bf16_to_float(chunk[j]);
  }
  for (int64_t g = 0; g < K / group; ++g) {
    float s = 0.0f;
    for (int k = 0; k < group; ++k) s += out[g * group + k];
    group_sums[g] = s;
  }
}

}  // namespace kt::kernels
