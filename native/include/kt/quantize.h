// Canonical (ISA- and layout-independent) quantized weights, and int8 activation rows.
//
// Canonical tensors of one matrix W[N, K] (K not padded; the last group may be partial), as each
// method's row of kMethodTable lists them:
//   BF16:           weight bf16 [N, K]
//   AMXINT8:        weight int8 [N, K] in -127..127,  scales fp16 [N, G]        w = scale * q
//   AMXINT4:        weight uint8 [N, ceil(K/2)] nibbles q in 0..15, low nibble = even k,
//                   scales fp16 [N, G], mins fp16 [N, G]                          w = scale * q + min
//   FP8:            weight e4m3 [N, K], scales fp32 [ceil(N/128), ceil(K/128)]   w = scale * e4m3
//   FP8_PERCHANNEL: weight e4m3 [N, K], scales fp32 [N]                          w = scale * e4m3
//   RAWINT4:        weight uint8 [N, ceil(K/2)] as AMXINT4, scales bf16 [N, G]   w = scale * (q - 8)
//   GPTQ_INT4:      weight uint8 [N, ceil(K/2)] as AMXINT4, scales fp16 [N, G],
//                   zeros uint8 [N, G]                                           w = scale * (q - zero)
//   MXFP4:          weight uint8 [N, ceil(K/2)] e2m1 codes, low nibble = even k,
//                   scales uint8 [N, G] e8m0                                     w = 2^(scale-127) * e2m1
//   NVFP4:          weight as MXFP4's, scales e4m3 [N, G] (groups of 16),
//                   global_scale fp32 [1]                                        w = scale * global * e2m1
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
  void* weight = nullptr;  // row-major, of the method's weight dtype
  void* scales = nullptr;  // quantized methods
  void* mins = nullptr;    // the third tensor: AMXINT4's mins, GPTQ_INT4's zeros, NVFP4's global_scale
  int64_t num_groups() const { return (K + group - 1) / group; }
  int64_t weight_row_bytes() const;
  // Whether the tensors the method needs are all there.
  bool complete() const;
};

// Quantizes rows [row_begin, row_end) of a dense matrix `src` [N, K] of dtype `dtype` into `dst`;
// throws std::invalid_argument naming the row and column of an inf or NaN weight.
void quantize_rows(const void* src, DType dtype, CanonicalMatrix& dst, int64_t row_begin, int64_t row_end);

// Index of the first inf or NaN of n values of `dtype` at `src`, or -1.
int64_t first_non_finite(const void* src, DType dtype, int64_t n);
// Throws std::invalid_argument: "<what> at row R, column C is NaN" (or "infinite").
[[noreturn]] void throw_non_finite(const char* what, int64_t row, int64_t col, float value);
// K values of `dtype` (columns col0.. of `row`) as floats; throws naming the row and column of an
// inf or NaN among them.
void load_checked_row(const void* src, DType dtype, int64_t K, int64_t row, int64_t col0, float* out);

// Throws std::invalid_argument naming the tensor, row and column of an inf or NaN in the floating
// tensors of `m` (bf16 weights, scales, mins).
void check_finite(const CanonicalMatrix& m);

// Quantizes one activation row of K floats (K a multiple of `group`) to int8: one scale per group,
// or with `per_row` one scale for the row, written to every group's slot (MethodTraits::
// gate_up_input_per_row). scaled_sum[g] = scale[g] * the sum of group g's int8 values.
void quantize_activation_row(const float* x, int64_t K, int group, bool per_row, int8_t* q, float* scale,
                             float* scaled_sum);

}  // namespace kt
