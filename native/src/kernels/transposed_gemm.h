// The fine-tuning backward's products with the frozen weights, transposed (kt/lora.h): dx = dg W
// with W [N, K] packed as panels of 16 rows of N. Each call decodes a 64-column block W[:, k0:k0 +
// 64] of the packed panels into bf16 panels of W^T (BF16's packed layout, reduction over N) in
// per-thread scratch, tile by tile through the table's LoraKernels, and runs the table's BF16 GEMM on
// it. No second copy of the weights is kept.
#pragma once

#include <cstdint>

#include "kt/kernels.h"
#include "kt/quant_types.h"

namespace kt {

// Columns of W per call: 4 panels of W^T.
inline constexpr int64_t kTransposedBlock = 64;

// c[i][kk] = sum_n a[i][n] W[n][k0 + kk] for kk < 64: W [N, K] packed in `method`, a's m rows bf16
// with round_up(N, 64) values (zeros past N); c written, not accumulated.
void gemm_transposed(const KernelTable& table, Method method, int group, const uint8_t* panels, int64_t N,
                     int64_t K, int64_t k0, int m, const uint16_t* const* rows, float* c, int64_t ldc);

}  // namespace kt
