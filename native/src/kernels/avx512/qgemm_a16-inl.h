// AVX-512 VNNI quantized weights x bf16 activations (decode). The activations are requantized to
// int16 per (row, group) inside the call (error ~1e-5, far below bf16's own rounding), then
// vpdpwssd multiplies them with the packed weights widened to 16 bits by a mask or a shift: no
// shuffles, two instructions per 64 weights for INT8, four for INT4's 128.
//
// Byte j of lane n of a VNNI row r is channel n, K-value 4r + j (quant_types.h); a 16-bit view of
// the lane holds bytes (0, 2) under a mask and (1, 3) after a shift, so the int16 activations store
// every 4 K-values as (0, 2, 1, 3) and the pairs line up. As in ../epilogue.h, one group adds
// sa * ws * D + scaled_sum * wm, D = sum(q16 * u).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../activations.h"
#include "../epilogue.h"
#include "../int16_rows.h"
#include "codes-inl.h"
#include "lanes.h"
#include "qgemm-inl.h"
#include "row_blocks-inl.h"

namespace kt::kernels::avx512 {

using Int16Rows = kernels::Int16Rows<struct Avx512Family>;

// Fills `rows` (../int16_rows.h) from m rows of A.
inline void quantize_int16_rows(Int16Rows& rows, const Bf16Rows& a, int m, int64_t K, int group) {
  const int64_t groups = K / group;
  rows.reserve(m, K, groups);
  // Within each 8 bytes (4 int16), the order (0, 2, 1, 3).
  const __m256i order =
      _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
  for (int i = 0; i < m; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 x[8];  // groups hold at most 128 K-values
      __m512 amax = _mm512_setzero_ps();
      for (int v = 0; v < group / 16; ++v) {
        const __m256i h =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16_at(a, i, g * group + 16 * v)));
        x[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        amax = _mm512_max_ps(amax, _mm512_abs_ps(x[v]));
      }
      const float top = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
      __m512i sum = _mm512_setzero_si512();
      int16_t* out = rows.q.data() + i * K + g * group;
      for (int v = 0; v < group / 16; ++v) {
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(x[v], inv));  // nearest even
        sum = _mm512_add_epi32(sum, qi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * v),
                            _mm256_shuffle_epi8(_mm512_cvtsepi32_epi16(qi), order));
      }
      const float s = top / 32767.0f;
      rows.scale[i * groups + g] = s;
      rows.scaled_sum[i * groups + g] = s * static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
}

template <class D, int kGroup, int kRows>
inline void gemm_a16_rows(int64_t K, const Int16Rows& a, int i0, const uint8_t* panel, float* const* out) {
  using C = typename D::Codes;
  constexpr int kPackedRows = packed_rows<C>(kGroup);
  constexpr int kChains = kRows == 1 ? 4 : 2;  // vpdpwssd latency
  const int64_t groups = K / kGroup;
  const int64_t gbytes = group_bytes(D::kMethod, kGroup), wbytes = group_weight_bytes(D::kMethod, kGroup);
  const int64_t ahead_bytes = prefetch_distance(gbytes);
  const CodeLanes<C> codes;
  __m512 acc[kRows];
  __m512i d[kRows][kChains];
  for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
  // Adds the 16-bit weights w (2 K-values per lane) times the activation pair at x[i] to chain c.
  auto dot = [&](__m512i w, const int16_t* const* x, int c) __attribute__((always_inline)) {
    for (int i = 0; i < kRows; ++i)
      d[i][c % kChains] = _mm512_dpwssd_epi32(d[i][c % kChains], w,
                                              _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x[i])));
  };
  for (int64_t gi = 0; gi < groups; ++gi) {
    const uint8_t* w = panel + gi * gbytes;
    const char* ahead = reinterpret_cast<const char*>(w) + ahead_bytes;
    for (int64_t off = 0; ahead_bytes > 0 && off < gbytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
    for (int i = 0; i < kRows; ++i)
      for (int u = 0; u < kChains; ++u) d[i][u] = _mm512_setzero_si512();
    const int16_t* x[kRows];
    for (int i = 0; i < kRows; ++i) x[i] = a.q.data() + (i0 + i) * K + gi * kGroup;
    const int16_t* xk[kRows];
    auto at = [&](int k) __attribute__((always_inline)) {
      for (int i = 0; i < kRows; ++i) xk[i] = x[i] + k;
      return xk;
    };
    for (int r = 0; r < kPackedRows; ++r) {
      const __m512i v = _mm512_loadu_si512(w + r * 64);
      // 16-bit lanes j: part j / 2, bytes 0, 2 (even j) or 1, 3 (odd j) of each channel.
      for (int j = 0; j < 2 * kParts<C>; ++j)
        dot(codes.words(v, j), at(part_k<C>(kGroup, r, j / 2) + 2 * (j % 2)), 2 * kParts<C> * r + j);
    }
    const auto [ws, wm] = D::template scales<Lanes>(w + wbytes, 0);
    for (int i = 0; i < kRows; ++i) {
      __m512i dsum = d[i][0];
      for (int u = 1; u < kChains; ++u) dsum = _mm512_add_epi32(dsum, d[i][u]);
      const int64_t s = (i0 + i) * groups + gi;
      acc[i] =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(dsum), _mm512_mul_ps(ws, _mm512_set1_ps(a.scale[s])), acc[i]);
      acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(a.scaled_sum[s]), acc[i]);
    }
  }
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

template <class D>
void gemm_quant_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                    float* c, int64_t ldc) {
  thread_local Int16Rows rows;
  quantize_int16_rows(rows, a, m, K, group);
  with_group(group, [&](auto group_size) {
    for_each_row_block(m, panels, npanels, panel_bytes(D::kMethod, group, K), c, ldc,
                       [&](auto rows_per_pass, int i0, const uint8_t* panel, float* const* out) {
                         gemm_a16_rows<D, decltype(group_size)::value, decltype(rows_per_pass)::value>(
                             K, rows, i0, panel, out);
                       });
  });
}

}  // namespace kt::kernels::avx512
