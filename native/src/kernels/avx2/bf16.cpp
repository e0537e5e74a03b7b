// AVX2 + FMA fallback for BF16: bf16 -> fp32 by shifts, fp32 FMA, 2 rows of A per pass.
#include <immintrin.h>

#include <algorithm>

#include "kt/kernels.h"
#include "kt/quant_types.h"

namespace kt::kernels::avx2 {

void gemm_bf16(int m, int64_t K, const uint16_t* const* a, const uint8_t* panels, int npanels,
               float* c, int64_t ldc) {
  constexpr int kRows = 2;
  const int64_t pbytes = panel_bytes(Method::kBf16, kKAlign, K);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* w = panels + p * pbytes;
    for (int i0 = 0; i0 < m; i0 += kRows) {
      const int mr = std::min(kRows, m - i0);
      __m256 acc[kRows][2];
      for (auto& r : acc) r[0] = r[1] = _mm256_setzero_ps();
      const uint16_t* arow[kRows];
      for (int i = 0; i < kRows; ++i) arow[i] = a[i0 + std::min(i, mr - 1)];
      for (int64_t k2 = 0; k2 < K / 2; ++k2) {
        __m256 even[2], odd[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k2 * 64 + h * 32));
          even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        }
        for (int i = 0; i < kRows; ++i) {
          const uint32_t a0 = static_cast<uint32_t>(arow[i][2 * k2]) << 16;
          const uint32_t a1 = static_cast<uint32_t>(arow[i][2 * k2 + 1]) << 16;
          const __m256 va0 = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(a0)));
          const __m256 va1 = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(a1)));
          for (int h = 0; h < 2; ++h)
            acc[i][h] = _mm256_fmadd_ps(odd[h], va1, _mm256_fmadd_ps(even[h], va0, acc[i][h]));
        }
      }
      for (int i = 0; i < mr; ++i)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + (i0 + i) * ldc + p * kPanelWidth + 8 * h, acc[i][h]);
    }
  }
}

}  // namespace kt::kernels::avx2
