// AMX quantized GEMM (INT8 and INT4): tdpbsud (s8 activations x u8 weights) on 32 rows x 32
// channels per step, int32 tiles stored after every group for the epilogue of ../epilogue.h. INT4
// groups are unpacked to int8 tiles first. Small batches and groups of 32 go to AVX-512.
#pragma once

#include <algorithm>
#include <vector>

#include "../epilogue.h"
#include "kt/kernels.h"
#include "tile_config.h"

namespace kt::kernels::amx {

template <Method M>
inline const uint8_t* b_tiles(const uint8_t* w, int group, uint8_t* unpacked) {
  if constexpr (M == Method::kInt8) {
    return w;
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const int half = group / 8;
    for (int r = 0; r < half; ++r) {
      const __m512i v = _mm512_loadu_si512(w + r * 64);
      _mm512_storeu_si512(unpacked + r * 64, _mm512_and_si512(v, nibble));
      _mm512_storeu_si512(unpacked + (r + half) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
    }
    return unpacked;
  }
}

template <Method M>
void gemm_quant(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels,
                float* c, int64_t ldc, GemmQuantFn small) {
  if (m <= 4 || group % 64 != 0) return small(m, K, group, a, panels, npanels, c, ldc);
  configure_tiles();
  const int64_t pbytes = panel_bytes(M, group, K);
  const int64_t gbytes = group_bytes(M, group), wbytes = group_weight_bytes(M, group);
  thread_local std::vector<uint8_t> stage, unpacked;
  thread_local int32_t d[32][32];
  thread_local float acc[32][32];
  if (stage.size() < static_cast<size_t>(32 * K)) stage.resize(32 * K);
  if (unpacked.size() < static_cast<size_t>(2 * group * 16)) unpacked.resize(2 * group * 16);
  for (int rb = 0; rb < m; rb += 32) {
    const int rows = std::min(32, m - rb);
    int64_t lda;
    const uint8_t* A = strided_rows(reinterpret_cast<const uint8_t* const*>(a.q + rb), rows, K,
                                    stage.data(), lda);
    for (int p = 0; p < npanels; p += 2) {
      const bool two = p + 1 < npanels;
      const uint8_t* w0 = panels + p * pbytes;
      const uint8_t* w1 = two ? w0 + pbytes : w0;
      for (int i = 0; i < rows; ++i) std::fill_n(acc[i], 32, 0.0f);
      for (int64_t gi = 0; gi < K / group; ++gi) {
        const uint8_t* g0 = w0 + gi * gbytes;
        const uint8_t* g1 = w1 + gi * gbytes;
        const uint8_t* b0 = b_tiles<M>(g0, group, unpacked.data());
        const uint8_t* b1 = b_tiles<M>(g1, group, unpacked.data() + group * 16);
        _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
        for (int kt = 0; kt < group / 64; ++kt) {
          const int64_t k = gi * group + kt * 64;
          _tile_loadd(4, A + k, lda);
          _tile_loadd(5, A + 16 * lda + k, lda);
          _tile_loadd(6, b0 + kt * 1024, 64);
          _tile_loadd(7, b1 + kt * 1024, 64);
          _tile_dpbsud(0, 4, 6);
          _tile_dpbsud(1, 4, 7);
          _tile_dpbsud(2, 5, 6);
          _tile_dpbsud(3, 5, 7);
        }
        _tile_stored(0, &d[0][0], 128);
        _tile_stored(1, &d[0][16], 128);
        _tile_stored(2, &d[16][0], 128);
        _tile_stored(3, &d[16][16], 128);
        __m512 ws[2], wm[2];
        for (int h = 0; h < 2; ++h) {
          const uint8_t* s = (h == 0 ? g0 : g1) + wbytes;
          ws[h] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
          wm[h] = M == Method::kInt8
                      ? _mm512_mul_ps(ws[h], _mm512_set1_ps(-128.0f))
                      : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32)));
        }
        for (int i = 0; i < rows; ++i) {
          const __m512 sa = _mm512_set1_ps(a.scale[rb + i][gi]);
          const __m512 ss = _mm512_set1_ps(a.scaled_sum[rb + i][gi]);
          for (int h = 0; h < 2; ++h) {
            const __m512 t = _mm512_mul_ps(wm[h], ss);
            const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(&d[i][16 * h])),
                                             _mm512_mul_ps(ws[h], sa), t);
            _mm512_storeu_ps(&acc[i][16 * h], _mm512_add_ps(_mm512_loadu_ps(&acc[i][16 * h]), v));
          }
        }
      }
      const int width = two ? 32 : 16;
      for (int i = 0; i < rows; ++i) std::copy_n(acc[i], width, c + (rb + i) * ldc + p * kPanelWidth);
    }
  }
}

}  // namespace kt::kernels::amx
