// AMX quantized GEMM (INT8 and INT4): tdpbsud (s8 activations x u8 weights) on 32 rows x 32
// channels per step. Every group's int32 tiles go to a buffer in one tight AMX loop, then one
// vector pass applies the group epilogue of ../epilogue.h (interleaving the two stalled both).
// INT4 panels are unpacked to int8 once per call. Small batches and groups of 32 go to AVX-512.
#pragma once

#include <algorithm>
#include <vector>

#include "../epilogue.h"
#include "tile_config.h"

namespace kt::kernels::amx {

// int8 B tiles of one group (group / 4 rows of 64 bytes) from the packed panel group `w`.
template <Method M>
inline void unpack_group(const uint8_t* w, int group, uint8_t* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const int half = group / 8;
  for (int r = 0; r < half; ++r) {
    const __m512i v = _mm512_loadu_si512(w + r * 64);
    _mm512_storeu_si512(out + r * 64, _mm512_and_si512(v, nibble));
    _mm512_storeu_si512(out + (r + half) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
  }
}

template <Method M>
void gemm_quant(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels,
                float* c, int64_t ldc, GemmQuantFn small) {
  if (m <= 4 || group % 64 != 0) return small(m, K, group, a, panels, npanels, c, ldc);
  configure_tiles();
  const int64_t groups = K / group;
  const int64_t pbytes = panel_bytes(M, group, K);
  const int64_t gbytes = group_bytes(M, group), wbytes = group_weight_bytes(M, group);
  const int64_t tile_bytes = group * kPanelWidth;  // int8 B bytes of one group of one panel
  thread_local std::vector<uint8_t> stage, unpacked;
  thread_local std::vector<int32_t> dots;  // [groups][32 rows][32 channels]
  thread_local float acc[32][32];
  if (stage.size() < static_cast<size_t>(kRowBlock * K)) stage.resize(kRowBlock * K);
  if (dots.size() < static_cast<size_t>(groups * 1024)) dots.resize(groups * 1024);
  if (M == Method::kInt4 && unpacked.size() < static_cast<size_t>(2 * groups * tile_bytes))
    unpacked.resize(2 * groups * tile_bytes);
  for (int p = 0; p < npanels; p += 2) {
    const bool two = p + 1 < npanels;
    const uint8_t* w0 = panels + p * pbytes;
    const uint8_t* w1 = two ? w0 + pbytes : w0;
    // B of group gi: INT8 straight from the panel, INT4 from its unpacked copy.
    auto b_tile = [&](int h, int64_t gi) -> const uint8_t* {
      if constexpr (M == Method::kInt8) return (h == 0 ? w0 : w1) + gi * gbytes;
      return unpacked.data() + (gi * 2 + h) * tile_bytes;
    };
    if constexpr (M == Method::kInt4) {
      for (int64_t gi = 0; gi < groups; ++gi) {
        unpack_group<M>(w0 + gi * gbytes, group, unpacked.data() + (gi * 2) * tile_bytes);
        unpack_group<M>(w1 + gi * gbytes, group, unpacked.data() + (gi * 2 + 1) * tile_bytes);
      }
    }
    for (int rb = 0; rb < m; rb += kRowBlock) {
      const int rows = std::min(kRowBlock, m - rb);
      const uint8_t* A = tiled_block(reinterpret_cast<const uint8_t* const*>(a.rows + rb),
                                     a.chunk_stride, rows, K, stage.data());
      for (int64_t gi = 0; gi < groups; ++gi) {
        const uint8_t* b0 = b_tile(0, gi);
        const uint8_t* b1 = b_tile(1, gi);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kt = 0; kt < group / 64; ++kt) {
          const uint8_t* chunk = A + (gi * group / 64 + kt) * kTiledChunkStride;
          _tile_loadd(4, chunk, 64);
          _tile_loadd(5, chunk + 16 * 64, 64);
          _tile_loadd(6, b0 + kt * 1024, 64);
          _tile_loadd(7, b1 + kt * 1024, 64);
          _tile_dpbsud(0, 4, 6);
          _tile_dpbsud(1, 4, 7);
          _tile_dpbsud(2, 5, 6);
          _tile_dpbsud(3, 5, 7);
        }
        int32_t* d = dots.data() + gi * 1024;
        _tile_stored(0, d, 128);
        _tile_stored(1, d + 16, 128);
        _tile_stored(2, d + 512, 128);
        _tile_stored(3, d + 512 + 16, 128);
      }
      for (int i = 0; i < rows; ++i) {
        const float* sa = a.scale[rb + i];
        const float* ss = a.scaled_sum[rb + i];
        for (int h = 0; h < 2; ++h) {
          const uint8_t* w = h == 0 ? w0 : w1;
          __m512 sum = _mm512_setzero_ps();
          for (int64_t gi = 0; gi < groups; ++gi) {
            const uint8_t* s = w + gi * gbytes + wbytes;
            const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
            const __m512 wm = M == Method::kInt8
                                  ? _mm512_mul_ps(ws, _mm512_set1_ps(-128.0f))
                                  : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32)));
            const __m512 dv = _mm512_cvtepi32_ps(_mm512_loadu_si512(dots.data() + gi * 1024 + i * 32 + 16 * h));
            const __m512 t = _mm512_mul_ps(wm, _mm512_set1_ps(ss[gi]));
            sum = _mm512_add_ps(sum, _mm512_fmadd_ps(dv, _mm512_mul_ps(ws, _mm512_set1_ps(sa[gi])), t));
          }
          _mm512_storeu_ps(&acc[i][16 * h], sum);
        }
      }
      const int width = two ? 32 : 16;
      for (int i = 0; i < rows; ++i) std::copy_n(acc[i], width, c + (rb + i) * ldc + p * kPanelWidth);
    }
  }
}

}  // namespace kt::kernels::amx
