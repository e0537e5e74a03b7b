// AVX-512 VNNI quantized GEMM (INT8 and INT4): vpdpbusd of packed u8 weights with broadcast s8
// activations, up to 4 rows of A per pass, the group epilogue of ../epilogue.h.
#pragma once

#include <immintrin.h>

#include "../activations.h"
#include "../epilogue.h"

namespace kt::kernels::avx512 {

template <Method M, int kRows>
inline void gemm_quant_rows(int64_t K, int group, const QuantRows& a, int i0, const uint8_t* panel,
                            float* const* out) {
  const int64_t gbytes = group_bytes(M, group), wbytes = group_weight_bytes(M, group);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[kRows];
  for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < K / group; ++gi) {
    const int64_t k0 = gi * group;
    const uint8_t* w = panel + gi * gbytes;
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * gbytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * gbytes + 256), _MM_HINT_T0);
    __m512i d[kRows];
    for (int i = 0; i < kRows; ++i) d[i] = _mm512_setzero_si512();
    if constexpr (M == Method::kInt8) {
      // A group of 32 is half a chunk, one of 128 two chunks.
      for (int c = 0; c < group; c += kChunkBytes) {
        const int quads = std::min<int>(kChunkBytes, group) / 4;
        const int32_t* x[kRows];
        for (int i = 0; i < kRows; ++i) x[i] = reinterpret_cast<const int32_t*>(quant_at(a, i0 + i, k0 + c));
        for (int r = 0; r < quads; ++r) {
          const __m512i wv = _mm512_loadu_si512(w + (c / 4 + r) * 64);
          for (int i = 0; i < kRows; ++i) d[i] = _mm512_dpbusd_epi32(d[i], wv, _mm512_set1_epi32(x[i][r]));
        }
      }
    } else {
      // Low nibbles hold the first half of the group, high nibbles the second.
      const int half = group / 8;
      const int32_t* lo_x[kRows];
      const int32_t* hi_x[kRows];
      for (int i = 0; i < kRows; ++i) {
        lo_x[i] = reinterpret_cast<const int32_t*>(quant_at(a, i0 + i, k0));
        hi_x[i] = reinterpret_cast<const int32_t*>(quant_at(a, i0 + i, k0 + group / 2));
      }
      for (int r = 0; r < half; ++r) {
        const __m512i v = _mm512_loadu_si512(w + r * 64);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int i = 0; i < kRows; ++i) {
          d[i] = _mm512_dpbusd_epi32(d[i], lo, _mm512_set1_epi32(lo_x[i][r]));
          d[i] = _mm512_dpbusd_epi32(d[i], hi, _mm512_set1_epi32(hi_x[i][r]));
        }
      }
    }
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + wbytes)));
    const __m512 wm = M == Method::kInt8
                          ? _mm512_mul_ps(ws, _mm512_set1_ps(-128.0f))
                          : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + wbytes + 32)));
    for (int i = 0; i < kRows; ++i) {
      const __m512 t = _mm512_mul_ps(wm, _mm512_set1_ps(a.scaled_sum[i0 + i][gi]));
      acc[i] = _mm512_add_ps(acc[i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[i]),
                                                     _mm512_mul_ps(ws, _mm512_set1_ps(a.scale[i0 + i][gi])), t));
    }
  }
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

template <Method M>
void gemm_quant(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels,
                float* c, int64_t ldc) {
  const int64_t pbytes = panel_bytes(M, group, K);
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* panel = panels + p * pbytes;
    int i0 = 0;
    for (; i0 + 4 <= m; i0 += 4) {
      float* out[4];
      for (int i = 0; i < 4; ++i) out[i] = c + (i0 + i) * ldc + p * kPanelWidth;
      gemm_quant_rows<M, 4>(K, group, a, i0, panel, out);
    }
    for (; i0 < m; ++i0) {
      float* out[1] = {c + i0 * ldc + p * kPanelWidth};
      gemm_quant_rows<M, 1>(K, group, a, i0, panel, out);
    }
  }
}

}  // namespace kt::kernels::avx512
