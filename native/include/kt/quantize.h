// Canonical (ISA- and layout-independent) quantized weights, and int8 activation rows.
//
// Canonical tensors of one matrix W[N, K] (K not padded; the last group may be partial):
//   BF16:    weight  bf16  [N, K]
//   AMXINT8: qweight int8  [N, K] in -127..127,  scales fp16 [N, G]        w = scale * q
//   AMXINT4: qweight uint8 [N, ceil(K/2)] nibbles q in 0..15, low nibble = even k,
//            scales fp16 [N, G], mins fp16 [N, G]                          w = scale * q + min
// with G = ceil(K / group). docs/weight-format.md describes the files built from them.
#pragma once

#include <cstdint>

#include "kt/float_types.h"
#include "kt/quant_types.h"

namespace kt {

struct CanonicalMatrix {
  Method method;
  int64_t N = 0, K = 0;
  int group = 0;
  void* weight = nullptr;      // bf16, int8 or packed uint8, row-major
  uint16_t* scales = nullptr;  // fp16 [N, G] (quantized methods)
  uint16_t* mins = nullptr;    // fp16 [N, G] (AMXINT4)
  int64_t num_groups() const { return (K + group - 1) / group; }
  int64_t weight_row_bytes() const;
};

// Quantizes rows [row_begin, row_end) of a dense matrix `src` [N, K] of dtype `dtype` into `dst`.
void quantize_rows(const void* src, DType dtype, CanonicalMatrix& dst, int64_t row_begin, int64_t row_end);

// Quantizes one activation row of K floats (K a multiple of `group`) to int8 per group.
void quantize_activation_row(const float* x, int64_t K, int group, int8_t* q, float* scale,
                             float* scaled_sum);

}  // namespace kt
