// AVX-512 VNNI quantized GEMM (INT8 and INT4): vpdpbusd of packed u8 weights with broadcast s8
// activations, 4 rows of A per pass, the group epilogue of ../epilogue.h.
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "../epilogue.h"
#include "kt/kernels.h"

namespace kt::kernels::avx512 {

template <Method M, int kRows>
inline void gemm_quant_rows(int mr, int64_t K, int group, const int8_t* const* q,
                            const float* const* scale, const float* const* ssum,
                            const uint8_t* panel, float* const* out) {
  const int64_t gbytes = group_bytes(M, group), wbytes = group_weight_bytes(M, group);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[kRows];
  for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < K / group; ++gi) {
    const uint8_t* w = panel + gi * gbytes;
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * gbytes), _MM_HINT_T0);
    __m512i d[kRows];
    for (int i = 0; i < kRows; ++i) d[i] = _mm512_setzero_si512();
    const int32_t* aq[kRows];
    for (int i = 0; i < kRows; ++i) aq[i] = reinterpret_cast<const int32_t*>(q[i] + gi * group);
    if constexpr (M == Method::kInt8) {
      for (int r = 0; r < group / 4; ++r) {
        const __m512i wv = _mm512_loadu_si512(w + r * 64);
        for (int i = 0; i < kRows; ++i) d[i] = _mm512_dpbusd_epi32(d[i], wv, _mm512_set1_epi32(aq[i][r]));
      }
    } else {
      const int half = group / 8;
      for (int r = 0; r < half; ++r) {
        const __m512i v = _mm512_loadu_si512(w + r * 64);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int i = 0; i < kRows; ++i) {
          d[i] = _mm512_dpbusd_epi32(d[i], lo, _mm512_set1_epi32(aq[i][r]));
          d[i] = _mm512_dpbusd_epi32(d[i], hi, _mm512_set1_epi32(aq[i][r + half]));
        }
      }
    }
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + wbytes)));
    const __m512 wm = M == Method::kInt8
                          ? _mm512_mul_ps(ws, _mm512_set1_ps(-128.0f))
                          : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + wbytes + 32)));
    for (int i = 0; i < kRows; ++i) {
      const __m512 t = _mm512_mul_ps(wm, _mm512_set1_ps(ssum[i][gi]));
      acc[i] = _mm512_add_ps(acc[i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[i]),
                                                     _mm512_mul_ps(ws, _mm512_set1_ps(scale[i][gi])), t));
    }
  }
  for (int i = 0; i < mr; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

template <Method M>
void gemm_quant(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels,
                float* c, int64_t ldc) {
  constexpr int kRows = 4;
  const int64_t pbytes = panel_bytes(M, group, K);
  for (int p = 0; p < npanels; ++p) {
    for (int i0 = 0; i0 < m; i0 += kRows) {
      const int mr = std::min(kRows, m - i0);
      const int8_t* q[kRows];
      const float* s[kRows];
      const float* ss[kRows];
      float* out[kRows];
      for (int i = 0; i < kRows; ++i) {
        const int r = i0 + std::min(i, mr - 1);  // short blocks repeat the last row, never store it
        q[i] = a.q[r], s[i] = a.scale[r], ss[i] = a.scaled_sum[r];
        out[i] = c + r * ldc + p * kPanelWidth;
      }
      if (mr == 1)
        gemm_quant_rows<M, 1>(mr, K, group, q, s, ss, panels + p * pbytes, out);
      else
        gemm_quant_rows<M, kRows>(mr, K, group, q, s, ss, panels + p * pbytes, out);
    }
  }
}

}  // namespace kt::kernels::avx512
