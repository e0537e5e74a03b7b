// Prefill over weights decoded to bf16 per K-chunk (FP8, RAWINT4, GPTQ_INT4): for each tile of up
// to 4 panels and each chunk of 512 K-values, the groups of those panels are decoded once into a
// 64 KiB buffer (BF16's packed rows), then every tile of up to 6 rows reads it from L2 and adds
// each group's sums times the group's channel scales into C. The decode costs a small share of a
// call however many rows it has.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../activations.h"
#include "../tiles.h"
#include "kt/aligned_vector.h"
#include "kt/kernels.h"

namespace kt::kernels::avx512 {

inline constexpr int64_t kDecodedChunkK = 512;
inline constexpr int kDecodedTileRows = 6, kDecodedTilePanels = 4;

// Groups [g0, g1) of a tile of kRows x kPanels from the decoded rows `dec` (panel p's row r at
// dec + (p * kDecodedChunkK / 2 + r) * 32, r counted from group g0); scale(p, gi) gives the 16
// channel scales of the tile's panel p, group gi. g0 == 0 writes C first; later groups add to it.
template <int kGroup, int kRows, int kPanels, class Scale>
__attribute__((noinline)) void gemm_decoded_tile(const Bf16Rows& a, int i0, const uint16_t* dec, int64_t g0,
                                                 int64_t g1, const Scale& scale, float* c, int64_t ldc) {
  for (int64_t gi = g0; gi < g1; ++gi) {
    __m512 acc[kRows][kPanels];
    for (int i = 0; i < kRows; ++i)
      for (int p = 0; p < kPanels; ++p) acc[i][p] = _mm512_setzero_ps();
    const uint16_t* dg = dec + (gi - g0) * kGroup / 2 * 32;
    for (int k = 0; k < kGroup; k += 32) {
      const int32_t* x[kRows];
      for (int i = 0; i < kRows; ++i)
        x[i] = reinterpret_cast<const int32_t*>(bf16_at(a, i0 + i, gi * kGroup + k));
      for (int j = 0; j < 16; ++j) {
        __m512bh wv[kPanels];
        for (int p = 0; p < kPanels; ++p)
          wv[p] = (__m512bh)_mm512_load_si512(dg + (p * kDecodedChunkK / 2 + k / 2 + j) * 32);
        for (int i = 0; i < kRows; ++i) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[i][j]);
          for (int p = 0; p < kPanels; ++p) acc[i][p] = _mm512_dpbf16_ps(acc[i][p], xv, wv[p]);
        }
      }
    }
    for (int p = 0; p < kPanels; ++p) {
      const __m512 ws = scale(p, gi);
      for (int i = 0; i < kRows; ++i) {
        float* out = c + (i0 + i) * ldc + p * kPanelWidth;
        const __m512 sum = gi == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out);
        _mm512_storeu_ps(out, _mm512_fmadd_ps(acc[i][p], ws, sum));
      }
    }
  }
}

// C = A W^T over `npanels` panels of `stride` bytes: decode(panel, gi, out) writes group gi of a
// panel as bf16 rows at `out` (kGroup / 2 rows of 32), scale(panel, gi) gives its channel scales.
template <int kGroup, class Decode, class Scale>
void gemm_decoded(int m, int64_t K, const Bf16Rows& a, const uint8_t* panels, int npanels, int64_t stride,
                  float* c, int64_t ldc, const Decode& decode, const Scale& scale) {
  thread_local AlignedVector<uint16_t> decoded;
  const size_t need = static_cast<size_t>(kDecodedTilePanels * kDecodedChunkK * kPanelWidth);
  if (decoded.size() < need) decoded.resize(need);
  for (int p0 = 0; p0 < npanels; p0 += kDecodedTilePanels)
    with_count<kDecodedTilePanels>(std::min(kDecodedTilePanels, npanels - p0), [&](auto tile_panels) {
      constexpr int kPanels = decltype(tile_panels)::value;
      const uint8_t* panel0 = panels + p0 * stride;
      const auto tile_scale = [&](int p, int64_t gi) { return scale(panel0 + p * stride, gi); };
      for (int64_t k0 = 0; k0 < K; k0 += kDecodedChunkK) {
        const int64_t g0 = k0 / kGroup, g1 = std::min(K, k0 + kDecodedChunkK) / kGroup;
        for (int p = 0; p < kPanels; ++p)
          for (int64_t gi = g0; gi < g1; ++gi)
            decode(panel0 + p * stride, gi,
                   decoded.data() + (p * kDecodedChunkK / 2 + (gi - g0) * kGroup / 2) * 32);
        for (int i0 = 0; i0 < m; i0 += kDecodedTileRows)
          with_count<kDecodedTileRows>(std::min(kDecodedTileRows, m - i0), [&](auto rows) {
            gemm_decoded_tile<kGroup, decltype(rows)::value, kPanels>(a, i0, decoded.data(), g0, g1,
                                                                      tile_scale, c + p0 * kPanelWidth, ldc);
          });
      }
    });
}

}  // namespace kt::kernels::avx512
