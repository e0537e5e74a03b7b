// AVX2 + FMA fallback for BF16: bf16 -> fp32 by shifts, fp32 FMA, on tiles of up to kRows rows x
// one panel (two halves of 8 channels): the weights are widened once per tile for all of its rows.
#include <immintrin.h>

#include "../../kernels/activations.h"
#include "../../kernels/tiles.h"
#include "kt/quant_types.h"

namespace kt::kernels::avx2 {

namespace {

// 4 x 2 fp32 sums, 4 widened weight vectors, the broadcast pair and the mask fill the 16 registers
// (Zen 4, Qwen3 at 512 tokens: 3 rows x0.85, 5 rows x0.81).
constexpr int kRows = 4;

template <int kTileRows>
void gemm_bf16_tile(int64_t K, const Bf16Rows& a, int i0, const uint8_t* w, float* c, int64_t ldc) {
  // A lone row keeps even and odd K-values in separate sums: with one FMA chain per half, the
  // chain's latency would bound a decode pass.
  constexpr int kSplit = kTileRows == 1 ? 2 : 1;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[kTileRows][2][kSplit];
  for (int i = 0; i < kTileRows; ++i)
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < kSplit; ++s) acc[i][h][s] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {  // one 64-byte chunk of each row: 16 K-pairs
    const int32_t* x[kTileRows];
    for (int i = 0; i < kTileRows; ++i) x[i] = reinterpret_cast<const int32_t*>(bf16_at(a, i0 + i, k));
    const uint8_t* wk = w + k * 64 / 2;
    for (int j = 0; j < 16; ++j) {
      __m256 even[2], odd[2];  // a pair (a0, a1) is the low and high half of one 32-bit lane
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + j * 64 + 32 * h));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
      for (int i = 0; i < kTileRows; ++i) {
        const __m256i pair = _mm256_set1_epi32(x[i][j]);
        const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
        const __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
        for (int h = 0; h < 2; ++h) {
          acc[i][h][0] = _mm256_fmadd_ps(even[h], a0, acc[i][h][0]);
          acc[i][h][kSplit - 1] = _mm256_fmadd_ps(odd[h], a1, acc[i][h][kSplit - 1]);
        }
      }
    }
  }
  for (int i = 0; i < kTileRows; ++i)
    for (int h = 0; h < 2; ++h) {
      __m256 sum = acc[i][h][0];
      if constexpr (kSplit == 2) sum = _mm256_add_ps(sum, acc[i][h][1]);
      _mm256_storeu_ps(c + (i0 + i) * ldc + 8 * h, sum);
    }
}

}  // namespace

void gemm_bf16(int m, int64_t K, int, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  const int64_t stride = panel_bytes(Method::kBf16, kKAlign, K);
  for_each_tile<kRows, 1>(m, npanels, [&](auto rows, auto, int i0, int p) {
    gemm_bf16_tile<decltype(rows)::value>(K, a, i0, panels + p * stride, c + p * kPanelWidth, ldc);
  });
}

}  // namespace kt::kernels::avx2
