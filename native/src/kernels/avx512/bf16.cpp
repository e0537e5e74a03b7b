// AVX-512 BF16: vdpbf16ps on the VNNI-paired panel rows, 4 rows of A per pass.
#include <immintrin.h>

#include <algorithm>

#include "kt/kernels.h"
#include "kt/quant_types.h"

namespace kt::kernels::avx512 {

void gemm_bf16(int m, int64_t K, const uint16_t* const* a, const uint8_t* panels, int npanels,
               float* c, int64_t ldc) {
  constexpr int kRows = 4;
  const int64_t pbytes = panel_bytes(Method::kBf16, kKAlign, K);
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* w = panels + p * pbytes;
    for (int i0 = 0; i0 < m; i0 += kRows) {
      const int mr = std::min(kRows, m - i0);
      __m512 acc[kRows];
      for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
      const int32_t* arow[kRows];
      for (int i = 0; i < kRows; ++i) arow[i] = reinterpret_cast<const int32_t*>(a[i0 + std::min(i, mr - 1)]);
      for (int64_t k2 = 0; k2 < K / 2; ++k2) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k2 * 64);
        _mm_prefetch(reinterpret_cast<const char*>(w + k2 * 64 + 1024), _MM_HINT_T0);
        for (int i = 0; i < kRows; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(arow[i][k2]), wv);
      }
      for (int i = 0; i < mr; ++i) _mm512_storeu_ps(c + (i0 + i) * ldc + p * kPanelWidth, acc[i]);
    }
  }
}

}  // namespace kt::kernels::avx512
