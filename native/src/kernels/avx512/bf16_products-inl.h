// The AVX-512 BF16 decode passes of the methods whose weights become bf16 values (BF16, FP8): up to
// 4 rows of A per pass of one panel (row_blocks-inl.h), vdpbf16ps on the decoded rows, kChains sums
// per row. A method contributes its weight decoder, an object W (its tables, held in registers):
//   W::kGroup                 K-values per scale group (0: none, one sum over all of K)
//   W::group_bytes(K)         bytes of one group (of all of K when kGroup is 0)
//   W.rows(w, k, j, r0, r1)   of the group at w, the packed rows (16 channels x 2 K-values) of
//                             K-values k + 2j.. and k + 2j + 2.. as bf16 (k a multiple of 32, j even)
//   W.scale(w)                the group's 16 channel scales (kGroup > 0 only)
// Prefill (more rows) takes tiles: BF16 reads its stored rows in place, the decoded methods decode a
// K-chunk of a few panels into a buffer first (decoded_tiles-inl.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../activations.h"
#include "kt/kernels.h"
#include "row_blocks-inl.h"

namespace kt::kernels::avx512 {

template <class W, int kRows>
void gemm_bf16_products_rows(const W& weights, int64_t K, const Bf16Rows& a, int i0, const uint8_t* panel,
                             float* const* out) {
  constexpr int kChains = kRows == 1 ? 4 : 2;  // vdpbf16ps latency; even: the rows come in pairs
  const W dec = weights;                       // a local copy keeps its tables in registers
  const int64_t ahead = weight_prefetch_bytes();
  const int64_t span = W::kGroup > 0 ? W::kGroup : K, gbytes = W::group_bytes(span);
  const int64_t chunk_bytes = gbytes / (span / 32);  // of 32 K-values
  __m512 total[kRows];
  for (int i = 0; i < kRows; ++i) total[i] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += span) {
    const uint8_t* w = panel + k0 / span * gbytes;
    if constexpr (W::kGroup > 0)  // the whole group, `ahead` bytes on
      for (int64_t off = 0; ahead > 0 && off < gbytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w) + ahead + off, _MM_HINT_T0);
    __m512 acc[kRows][kChains];
    for (int i = 0; i < kRows; ++i)
      for (int u = 0; u < kChains; ++u) acc[i][u] = _mm512_setzero_ps();
    for (int64_t k = 0; k < span; k += 32) {  // 16 K-pairs of each row
      if constexpr (W::kGroup == 0)           // every line of the chunk, `ahead` bytes on
        for (int64_t off = 0; ahead > 0 && off < chunk_bytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w) + k / 32 * chunk_bytes + ahead + off, _MM_HINT_T0);
      const int32_t* x[kRows];
      for (int i = 0; i < kRows; ++i) x[i] = reinterpret_cast<const int32_t*>(bf16_at(a, i0 + i, k0 + k));
      for (int j = 0; j < 16; j += kChains)
        for (int u = 0; u < kChains; u += 2) {
          __m512bh wv[2];
          dec.rows(w, k, j + u, wv[0], wv[1]);
          for (int v = 0; v < 2; ++v)
            for (int i = 0; i < kRows; ++i)
              acc[i][u + v] =
                  _mm512_dpbf16_ps(acc[i][u + v], (__m512bh)_mm512_set1_epi32(x[i][j + u + v]), wv[v]);
        }
    }
    for (int i = 0; i < kRows; ++i) {
      __m512 sum = acc[i][0];
      for (int u = 1; u < kChains; ++u) sum = _mm512_add_ps(sum, acc[i][u]);
      if constexpr (W::kGroup > 0)
        total[i] = _mm512_fmadd_ps(sum, dec.scale(w), total[i]);
      else
        total[i] = _mm512_add_ps(total[i], sum);
    }
  }
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(out[i], total[i]);
}

// The decode passes over `npanels` panels of `stride` bytes, rows in blocks of 4.
template <class W>
void gemm_bf16_products_passes(const W& weights, int m, int64_t K, const Bf16Rows& a, const uint8_t* panels,
                               int npanels, int64_t stride, float* c, int64_t ldc) {
  for_each_row_block(m, panels, npanels, stride, c, ldc,
                     [&](auto rows, int i0, const uint8_t* panel, float* const* out) {
                       gemm_bf16_products_rows<W, decltype(rows)::value>(weights, K, a, i0, panel, out);
                     });
}

}  // namespace kt::kernels::avx512
