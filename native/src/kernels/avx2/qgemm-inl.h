// AVX2 quantized GEMM (INT8 and INT4) without VNNI: vpmaddubsw on 4-bit weight halves (so the s16
// pair sums cannot saturate: 15 * 127 * 2 < 32767), vpmaddwd to widen; one row of A per pass.
#pragma once

#include <immintrin.h>

#include "../activations.h"
#include "../epilogue.h"

namespace kt::kernels::avx2 {

// Adds sum over 4 K-values of a * w for 8 channels: w are 4-bit values in u8 lanes.
inline __m256i dot4(__m256i acc, __m256i w, __m256i a, __m256i factor) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), factor));
}

template <Method M>
void gemm_quant(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
                int64_t ldc) {
  const int64_t pbytes = panel_bytes(M, group, K);
  const int64_t gbytes = group_bytes(M, group), wbytes = group_weight_bytes(M, group);
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);  // madd factors
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* panel = panels + p * pbytes;
    for (int i = 0; i < m; ++i) {
      __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t gi = 0; gi < K / group; ++gi) {
        const uint8_t* w = panel + gi * gbytes;
        const int64_t k0 = gi * group;
        __m256i d[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if constexpr (M == Method::kInt8) {
          for (int r = 0; r < group / 4; ++r) {
            const auto* x = reinterpret_cast<const int32_t*>(quant_at(a, i, k0 + 4 * r));
            const __m256i av = _mm256_set1_epi32(*x);
            for (int h = 0; h < 2; ++h) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * 64 + h * 32));
              d[h] = dot4(d[h], _mm256_and_si256(v, nibble), av, ones);
              d[h] = dot4(d[h], _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), av, sixteen);
            }
          }
        } else {
          const int half = group / 8;
          const auto* lo_x = reinterpret_cast<const int32_t*>(quant_at(a, i, k0));
          const auto* hi_x = reinterpret_cast<const int32_t*>(quant_at(a, i, k0 + group / 2));
          for (int r = 0; r < half; ++r) {
            const __m256i alo = _mm256_set1_epi32(lo_x[r]), ahi = _mm256_set1_epi32(hi_x[r]);
            for (int h = 0; h < 2; ++h) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * 64 + h * 32));
              d[h] = dot4(d[h], _mm256_and_si256(v, nibble), alo, ones);
              d[h] = dot4(d[h], _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), ahi, ones);
            }
          }
        }
        const float sa = a.scale[i][gi], ssum = a.scaled_sum[i][gi];
        for (int h = 0; h < 2; ++h) {
          const __m256 ws =
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + wbytes + 16 * h)));
          const __m256 wm = M == Method::kInt8
                                ? _mm256_mul_ps(ws, _mm256_set1_ps(-128.0f))
                                : _mm256_cvtph_ps(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(w + wbytes + 32 + 16 * h)));
          const __m256 t = _mm256_mul_ps(wm, _mm256_set1_ps(ssum));
          acc[h] = _mm256_add_ps(
              acc[h], _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[h]), _mm256_mul_ps(ws, _mm256_set1_ps(sa)), t));
        }
      }
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + i * ldc + p * kPanelWidth + 8 * h, acc[h]);
    }
  }
}

}  // namespace kt::kernels::avx2
