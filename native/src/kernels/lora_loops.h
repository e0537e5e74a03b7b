// The adapters' fp32 loops of the fine-tuning kernels (kt/kernels.h, LoraKernels): portable code
// that each family's kernels/<isa>/lora_loops.cpp instantiates with its own Isa and compiles with
// its own flags, so that the compiler vectorizes it per family (the Isa parameter keeps the copies
// apart: one symbol per family; only lora_loops.cpp may instantiate them). The AVX2 and AVX-512
// copies take the flags GCC's target_clones("avx2", "avx512f") gave these loops before they joined
// the table (CMakeLists.txt): AVX2 without FMA contraction, AVX-512F alone.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kt/cpu_features.h"
#include "kt/float_types.h"
#include "kt/kernels.h"

namespace kt::kernels::lora {

// C[i][j] += alpha * sum_k A[i][k] B[j][k]  (A [m, K], B [n, K]): dot products, 16 partial sums.
template <Isa>
void gemm_nt(int64_t m, int64_t n, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float* a = A + i * lda;
      const float* b = B + j * ldb;
      float acc[16] = {};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; ++l) acc[l] += a[k + l] * b[k + l];
      float sum = 0.0f;
      for (; k < K; ++k) sum += a[k] * b[k];
      for (int l = 0; l < 16; ++l) sum += acc[l];
      C[i * ldc + j] += alpha * sum;
    }
}

// C[i][:] += alpha * sum_k A[i][k] B[k][:]  (A [m, K], B [K, n]), added in k order. A row's sums are
// kept 64 columns at a time over all of K and stored once: stored after each k, a load of B 4 KiB
// away from a C line just stored waited on it, and the fine-tuning forward's adapter terms (B
// [16, 64] beside C rows 512 bytes apart) took 1.6-1.7x as long.
template <Isa>
void gemm_nn(int64_t m, int64_t n, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc) {
  constexpr int64_t kCols = 64;
  for (int64_t i = 0; i < m; ++i) {
    float* c = C + i * ldc;
    int64_t j0 = 0;
    for (; j0 + kCols <= n; j0 += kCols) {
      float acc[kCols];
      for (int64_t j = 0; j < kCols; ++j) acc[j] = c[j0 + j];
      for (int64_t k = 0; k < K; ++k) {
        const float a = alpha * A[i * lda + k];
        const float* b = B + k * ldb + j0;
        for (int64_t j = 0; j < kCols; ++j) acc[j] += a * b[j];
      }
      for (int64_t j = 0; j < kCols; ++j) c[j0 + j] = acc[j];
    }
    for (int64_t k = 0; k < K && j0 < n; ++k) {
      const float a = alpha * A[i * lda + k];
      const float* b = B + k * ldb;
      for (int64_t j = j0; j < n; ++j) c[j] += a * b[j];
    }
  }
}

// C[i][:] += alpha * sum_k A[k][i] B[k][:]  (A [K, m], B [K, n]): the adapters' gradients.
template <Isa>
void gemm_tn(int64_t m, int64_t n, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc) {
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    for (int64_t i = 0; i < m; ++i) {
      const float a = alpha * A[k * lda + i];
      if (a == 0.0f) continue;
      float* c = C + i * ldc;
      for (int64_t j = 0; j < n; ++j) c[j] += a * b[j];
    }
  }
}

template <Isa>
void bf16_row_to_float(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

// The silu(g) * u gate's backward: dg = dh u silu'(g), du = dh silu(g).
template <Isa>
void silu_mul_backward(const float* g, const float* u, const float* dh, int64_t n, float* dg, float* du) {
  for (int64_t i = 0; i < n; ++i) {
    const float sig = 1.0f / (1.0f + std::exp(-g[i]));
    const float silu = g[i] * sig;
    dg[i] = dh[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
    du[i] = dh[i] * silu;
  }
}

// The family's copies of the loops into the table.
template <Isa I>
void set_fp32_loops(LoraKernels& k) {
  k.gemm_nt = gemm_nt<I>, k.gemm_nn = gemm_nn<I>, k.gemm_tn = gemm_tn<I>;
  k.bf16_row_to_float = bf16_row_to_float<I>, k.silu_mul_backward = silu_mul_backward<I>;
  k.isa = I;
}

// k.decode_tile[m] = pick(std::integral_constant<Method, m>{}) for each method m it gives one for
// (not null): a family's own tile decoders over the lower family's.
template <class Pick>
void set_decoders(LoraKernels& k, Pick pick) {
  [&]<int... Ms>(std::integer_sequence<int, Ms...>) {
    const DecodeTileFn picked[] = {pick(std::integral_constant<Method, static_cast<Method>(Ms)>{})...};
    for (int m = 0; m < kNumMethods; ++m)
      if (picked[m]) k.decode_tile[m] = picked[m];
  }(std::make_integer_sequence<int, kNumMethods>{});
}

}  // namespace kt::kernels::lora

namespace kt::kernels {

// Each family's copies of the loops into the table (<isa>/lora_loops.cpp).
namespace scalar {
void lora_loops(LoraKernels& k);
}
namespace avx2 {
void lora_loops(LoraKernels& k);
}
namespace avx512 {
void lora_loops(LoraKernels& k);
}

}  // namespace kt::kernels
