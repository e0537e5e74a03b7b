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

}  // namespace kt::kernels
