// AVX2 + FMA fallback for BF16: bf16 -> fp32 by shifts, fp32 FMA, one row of A per pass.
#include <immintrin.h>

#include "../activations.h"
#include "kt/quant_types.h"

namespace kt::kernels::avx2 {

void gemm_bf16(int m, int64_t K, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  const int64_t pbytes = panel_bytes(Method::kBf16, kKAlign, K);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* w = panels + p * pbytes;
    for (int i = 0; i < m; ++i) {
      __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t k = 0; k < K; k += 32) {
        const uint32_t* x = reinterpret_cast<const uint32_t*>(bf16_at(a, i, k));
        for (int j = 0; j < 16; ++j) {
          const uint8_t* row = w + (k / 2 + j) * 64;
          // A pair (a0, a1) as fp32: a0 is the low half, a1 the high half of the 32-bit word.
          const __m256 va0 = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(x[j] << 16)));
          const __m256 va1 = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(x[j] & 0xffff0000u)));
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + h * 32));
            const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            acc[h] = _mm256_fmadd_ps(odd, va1, _mm256_fmadd_ps(even, va0, acc[h]));
          }
        }
      }
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + i * ldc + p * kPanelWidth + 8 * h, acc[h]);
    }
  }
}

}  // namespace kt::kernels::avx2
