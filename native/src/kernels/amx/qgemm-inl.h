// AMX quantized GEMM (INT8 and INT4): tdpbsud (s8 activations x u8 weights), 32 rows x 32 channels
// per step, with the group epilogue of ../epilogue.h after every group.
//
// Loop order: channel pair (2 panels) > group > block of 32 rows. The pair's B tiles of a group are
// loaded once and stay in tile registers for every row block; the pair's fp32 sums (m x 32) stay in
// L1; int32 tiles go to one of two small buffers so the vector epilogue of one row block overlaps
// the AMX work of the next. Small batches and groups of 32 go to AVX-512.
#pragma once

#include <algorithm>
#include <vector>

#include "../epilogue.h"
#include "tile_config.h"

namespace kt::kernels::amx {

// int8 B tile rows of one group (group / 4 rows of 64 bytes) from a packed INT4 panel group.
inline void unpack_int4_group(const uint8_t* w, int group, uint8_t* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const int half = group / 8;
  for (int r = 0; r < half; ++r) {
    const __m512i v = _mm512_loadu_si512(w + r * 64);
    _mm512_storeu_si512(out + r * 64, _mm512_and_si512(v, nibble));
    _mm512_storeu_si512(out + (r + half) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
  }
}

template <Method M>
void gemm_quant(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
                int64_t ldc, GemmQuantFn small) {
  if (m <= 4 || group % 64 != 0) return small(m, K, group, a, panels, npanels, c, ldc);
  configure_tiles();
  const int64_t groups = K / group;
  const int ktiles = group / 64;
  const int blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t pbytes = panel_bytes(M, group, K);
  const int64_t gbytes = group_bytes(M, group), wbytes = group_weight_bytes(M, group);
  thread_local std::vector<uint8_t> stage;        // rows that are not tiled yet
  thread_local std::vector<const uint8_t*> base;  // per row block
  thread_local std::vector<float> acc;            // [blocks * 32][32]
  alignas(64) thread_local int32_t dots[2][32][32];
  alignas(64) thread_local uint8_t unpacked[2][128 * 16];
  if (stage.size() < static_cast<size_t>(blocks * kRowBlock * K)) stage.resize(blocks * kRowBlock * K);
  if (acc.size() < static_cast<size_t>(blocks * kRowBlock * 32)) acc.resize(blocks * kRowBlock * 32);
  base.resize(blocks);
  for (int b = 0; b < blocks; ++b) {
    const int rows = std::min(kRowBlock, m - b * kRowBlock);
    base[b] = tiled_block(reinterpret_cast<const uint8_t* const*>(a.rows + b * kRowBlock), a.chunk_stride,
                          rows, K, stage.data() + b * kRowBlock * K);
  }
  for (int p = 0; p < npanels; p += 2) {
    const bool two = p + 1 < npanels;
    const uint8_t* w0 = panels + p * pbytes;
    const uint8_t* w1 = two ? w0 + pbytes : w0;
    std::fill_n(acc.data(), blocks * kRowBlock * 32, 0.0f);
    for (int64_t gi = 0; gi < groups; ++gi) {
      const uint8_t* g0 = w0 + gi * gbytes;
      const uint8_t* g1 = w1 + gi * gbytes;
      const uint8_t* b0 = g0;
      const uint8_t* b1 = g1;
      if constexpr (M == Method::kInt4) {
        unpack_int4_group(g0, group, unpacked[0]);
        unpack_int4_group(g1, group, unpacked[1]);
        b0 = unpacked[0], b1 = unpacked[1];
      }
      __m512 ws[2], wm[2];
      for (int h = 0; h < 2; ++h) {
        const uint8_t* s = (h == 0 ? g0 : g1) + wbytes;
        ws[h] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
        wm[h] = M == Method::kInt8
                    ? _mm512_mul_ps(ws[h], _mm512_set1_ps(-128.0f))
                    : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32)));
      }
      if (ktiles == 1) {  // the group's B tiles stay loaded for every row block
        _tile_loadd(6, b0, 64);
        _tile_loadd(7, b1, 64);
      }
      {
        for (int b = 0; b < blocks; ++b) {
          const int rows = std::min(kRowBlock, m - b * kRowBlock);
          int32_t (*d)[32] = dots[b & 1];
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int t = 0; t < ktiles; ++t) {  // groups of 128: two K-tiles per group
            const uint8_t* chunk = base[b] + (gi * ktiles + t) * kTiledChunkStride;
            if (ktiles > 1) {
              _tile_loadd(6, b0 + t * 1024, 64);
              _tile_loadd(7, b1 + t * 1024, 64);
            }
            _tile_loadd(4, chunk, 64);
            _tile_loadd(5, chunk + 16 * 64, 64);
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 4, 7);
            _tile_dpbsud(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
          }
          _tile_stored(0, &d[0][0], 128);
          _tile_stored(1, &d[0][16], 128);
          _tile_stored(2, &d[16][0], 128);
          _tile_stored(3, &d[16][16], 128);
          float* sums = acc.data() + b * kRowBlock * 32;
          for (int i = 0; i < rows; ++i) {
            const int r = b * kRowBlock + i;
            const __m512 sa = _mm512_set1_ps(a.scale[r][gi]);
            const __m512 ss = _mm512_set1_ps(a.scaled_sum[r][gi]);
            for (int h = 0; h < 2; ++h) {
              const __m512 dv = _mm512_cvtepi32_ps(_mm512_load_si512(&d[i][16 * h]));
              __m512 s = _mm512_loadu_ps(sums + i * 32 + 16 * h);
              s = _mm512_fmadd_ps(_mm512_mul_ps(dv, ws[h]), sa, s);
              s = _mm512_fmadd_ps(wm[h], ss, s);
              _mm512_storeu_ps(sums + i * 32 + 16 * h, s);
            }
          }
        }
      }
    }
    const int width = two ? 32 : 16;
    for (int i = 0; i < m; ++i) std::copy_n(acc.data() + i * 32, width, c + i * ldc + p * kPanelWidth);
  }
}

}  // namespace kt::kernels::amx
