// The AVX2 + FMA skeleton of the methods whose weights become bf16 values (BF16, FP8): fp32 FMA on
// tiles of up to kTileRows rows x one panel (two halves of 8 channels), the weights decoded once per
// tile for all of its rows. A method contributes its weight decoder, an object W (as on AVX-512,
// ../avx512/bf16_products-inl.h):
//   W::kGroup                      K-values per scale group (0: none, one sum over all of K)
//   W::group_bytes(K)              bytes of one group (of all of K when kGroup is 0)
//   W.decode(w, k, j, even, odd)   of the group at w, K-values k + 2j and k + 2j + 1 (k a multiple
//                                  of 32, 0 <= j < 16) of channels 8h..8h+7 as fp32 even[h], odd[h]
//   W.scale(w, h)                  the group's scales of channels 8h..8h+7 (kGroup > 0 only)
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../activations.h"
#include "../tiles.h"

namespace kt::kernels::avx2 {

// 4 x 2 fp32 sums, 4 decoded weight vectors, the broadcast pair and the mask fill the 16 registers
// (Zen 4, BF16, Qwen3 at 512 tokens: 3 rows x0.85, 5 rows x0.81).
inline constexpr int kBf16TileRows = 4;

template <class W, int kTileRows>
void gemm_bf16_products_tile(const W& weights, int64_t K, const Bf16Rows& a, int i0, const uint8_t* panel,
                             float* c, int64_t ldc) {
  // A lone row keeps even and odd K-values in separate sums: with one FMA chain per half, the
  // chain's latency would bound a decode pass.
  constexpr int kSplit = kTileRows == 1 ? 2 : 1;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t span = W::kGroup > 0 ? W::kGroup : K;
  for (int64_t k0 = 0; k0 < K; k0 += span) {
    const uint8_t* w = panel + k0 / span * W::group_bytes(span);
    __m256 acc[kTileRows][2][kSplit];
    for (int i = 0; i < kTileRows; ++i)
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < kSplit; ++s) acc[i][h][s] = _mm256_setzero_ps();
    for (int64_t k = 0; k < span; k += 32) {  // 16 K-pairs of each row
      const int32_t* x[kTileRows];
      for (int i = 0; i < kTileRows; ++i) x[i] = reinterpret_cast<const int32_t*>(bf16_at(a, i0 + i, k0 + k));
      for (int j = 0; j < 16; ++j) {
        __m256 even[2], odd[2];
        weights.decode(w, k, j, even, odd);
        for (int i = 0; i < kTileRows; ++i) {
          const __m256i pair = _mm256_set1_epi32(x[i][j]);  // (a0, a1): the low and high halves
          const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
          const __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
          for (int h = 0; h < 2; ++h) {
            acc[i][h][0] = _mm256_fmadd_ps(even[h], a0, acc[i][h][0]);
            acc[i][h][kSplit - 1] = _mm256_fmadd_ps(odd[h], a1, acc[i][h][kSplit - 1]);
          }
        }
      }
    }
    // The sums of earlier groups live in C: in registers they would not leave room for the weights.
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < kTileRows; ++i) {
        __m256 sum = acc[i][h][0];
        if constexpr (kSplit == 2) sum = _mm256_add_ps(sum, acc[i][h][1]);
        float* out = c + (i0 + i) * ldc + 8 * h;
        if constexpr (W::kGroup > 0)
          sum =
              _mm256_fmadd_ps(sum, weights.scale(w, h), k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out));
        _mm256_storeu_ps(out, sum);
      }
  }
}

// C = A W^T over `npanels` panels of `stride` bytes.
template <class W>
void gemm_bf16_products(const W& weights, int m, int64_t K, const Bf16Rows& a, const uint8_t* panels,
                        int npanels, int64_t stride, float* c, int64_t ldc) {
  for_each_tile<kBf16TileRows, 1>(m, npanels, [&](auto rows, auto, int i0, int p) {
    gemm_bf16_products_tile<W, decltype(rows)::value>(weights, K, a, i0, panels + p * stride,
                                                      c + p * kPanelWidth, ldc);
  });
}

}  // namespace kt::kernels::avx2
