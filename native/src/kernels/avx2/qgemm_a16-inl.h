// AVX2 quantized weights x bf16 activations: the AVX-512 A16 scheme (../avx512/qgemm_a16-inl.h)
// with vpmaddwd + vpaddd for vpdpwssd, on tiles of up to kTileRows rows x one panel (two halves of
// 8 channels). The activations are requantized to int16 per (row, group) once per call; the
// weights are widened to 16 bits by a mask or a shift, once per tile for all of its rows.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "../activations.h"
#include "../epilogue.h"
#include "../int16_rows.h"
#include "../tiles.h"
#include "codes-inl.h"
#include "qgemm-inl.h"

namespace kt::kernels::avx2 {

using Int16Rows = kernels::Int16Rows<struct Avx2Family>;

// Fills `rows` (../int16_rows.h) from m rows of A; the same values as the AVX-512 path's.
inline void quantize_int16_rows(Int16Rows& rows, const Bf16Rows& a, int m, int64_t K, int group) {
  const int64_t groups = K / group;
  rows.reserve(m, K, groups);
  const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto load8 = [&](int i, int64_t k) {  // 8 bf16 values as fp32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bf16_at(a, i, k)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  for (int i = 0; i < m; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * group;
      __m256 amax = _mm256_setzero_ps();
      for (int v = 0; v < group; v += 8)
        amax = _mm256_max_ps(amax, _mm256_and_ps(load8(i, k0 + v), magnitude));
      __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
      const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
      const __m256 inv = _mm256_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
      __m256i sum = _mm256_setzero_si256();
      int16_t* out = rows.q.data() + i * K + k0;
      for (int v = 0; v < group; v += 8) {
        const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(load8(i, k0 + v), inv));  // nearest even
        sum = _mm256_add_epi32(sum, qi);
        const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + v), _mm_shuffle_epi8(q16, order));
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      const float s = top / 32767.0f;
      rows.scale[i * groups + g] = s;
      rows.scaled_sum[i * groups + g] = s * static_cast<float>(_mm_cvtsi128_si32(s4));
    }
}

template <class D, int kGroup, int kRows>
inline void gemm_a16_tile(int64_t K, const Int16Rows& a, int i0, const uint8_t* panel, float* c,
                          int64_t ldc) {
  using C = typename D::Codes;
  constexpr int kPackedRows = packed_rows<C>(kGroup);
  constexpr int64_t gbytes = group_bytes(D::kMethod, kGroup), wbytes = group_weight_bytes(D::kMethod, kGroup);
  const int64_t groups = K / kGroup;
  const CodeLanes<C> codes;
  const int64_t ahead = prefetch_distance(gbytes);
  for (int64_t gi = 0; gi < groups; ++gi) {
    const uint8_t* w = panel + gi * gbytes;
    for (int64_t off = 0; ahead > 0 && off < gbytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w) + ahead + off, _MM_HINT_T1);
    __m256i d[kRows][2];
    for (int i = 0; i < kRows; ++i) d[i][0] = d[i][1] = _mm256_setzero_si256();
    const int16_t* x[kRows];
    for (int i = 0; i < kRows; ++i) x[i] = a.q.data() + (i0 + i) * K + gi * kGroup;
    // Adds the 16-bit weights wv of half h (2 K-values per lane) times each row's pair at x + k.
    auto dot = [&](int h, __m256i wv, int k) __attribute__((always_inline)) {
      for (int i = 0; i < kRows; ++i)
        d[i][h] = _mm256_add_epi32(
            d[i][h], _mm256_madd_epi16(wv, _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x[i] + k))));
    };
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < kPackedRows; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * 64 + 32 * h));
        // 16-bit lanes j: part j / 2, bytes 0, 2 (even j) or 1, 3 (odd j) of each channel.
        for (int j = 0; j < 2 * kParts<C>; ++j)
          dot(h, codes.words(v, j), part_k<C>(kGroup, r, j / 2) + 2 * (j % 2));
      }
    for (int h = 0; h < 2; ++h) {
      const auto [ws, wm] = D::template scales<Lanes>(w + wbytes, 8 * h);
      for (int i = 0; i < kRows; ++i) {
        const int64_t s = (i0 + i) * groups + gi;
        float* out = c + (i0 + i) * ldc + 8 * h;
        const __m256 sum = _mm256_fmadd_ps(wm, _mm256_set1_ps(a.scaled_sum[s]),
                                           gi == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[i][h]),
                                              _mm256_mul_ps(ws, _mm256_set1_ps(a.scale[s])), sum));
      }
    }
  }
}

template <class D>
void gemm_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  thread_local Int16Rows rows;
  quantize_int16_rows(rows, a, m, K, group);
  const int64_t stride = panel_bytes(D::kMethod, group, K);
  with_group(group, [&](auto group_size) {
    for_each_tile<kTileRows, 1>(m, npanels, [&](auto tile_rows, auto, int i0, int p) {
      gemm_a16_tile<D, decltype(group_size)::value, decltype(tile_rows)::value>(
          K, rows, i0, panels + p * stride, c + p * kPanelWidth, ldc);
    });
  });
}

}  // namespace kt::kernels::avx2
