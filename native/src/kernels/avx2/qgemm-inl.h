// AVX2 quantized GEMM (the integer methods) without VNNI, on tiles of up to kTileRows rows x one panel
// (two halves of 8 channels): each weight vector loaded and unpacked serves every row of the tile.
// vpmaddubsw multiplies unsigned by signed bytes into s16 pair sums of the codes' values
// (codes-inl.h, CodeLanes::pair_sums: signed values as |q| times the activation carrying q's sign,
// so INT8's dot product is over q itself and the offset term of ../epilogue.h drops out), added
// over the parts of a packed row in s16. vpmaddwd by ones widens to int32. The fp32 sums live in C
// (read and written once per group).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "../activations.h"
#include "../epilogue.h"
#include "../tiles.h"
#include "codes-inl.h"
#include "kt/kernels.h"
#include "lanes.h"

namespace kt::kernels::avx2 {

// Rows per tile: 4 x 2 int32 sums plus the unpacked weights, the broadcast and the constants fill
// the 16 registers (Zen 4, Qwen3 at 512 tokens: 3 rows x0.97-0.99, 5 rows x0.97-1.00).
inline constexpr int kTileRows = 4;

template <class D, int kGroup, int kRows>
inline void gemm_quant_tile(int64_t K, const QuantRows& a, int i0, const uint8_t* panel, float* c,
                            int64_t ldc) {
  using C = typename D::Codes;
  constexpr int kPackedRows = packed_rows<C>(kGroup);  // a constant: GCC ignores unroll pragmas on a call
  constexpr int64_t gbytes = group_bytes(D::kMethod, kGroup), wbytes = group_weight_bytes(D::kMethod, kGroup);
  // A step is one chunk of activations (64 K-values) or one group of several chunks, so every
  // activation offset inside it is known at compile time (as in the AVX-512 decode pass; Qwen3
  // layer, Q4_K GGUF, Emerald Rapids: one token x1.02-1.03, 128 tokens x1.07-1.12).
  constexpr int kStepK = kGroup > kChunkBytes ? kGroup : kChunkBytes;
  const __m256i ones = _mm256_set1_epi16(1);
  const CodeLanes<C> codes;
  // Prefetch ahead of the weight stream into L2 as the AVX-512 kernels do (weight_prefetch_bytes: 4
  // KiB on Intel, none elsewhere): on an Emerald Rapids core, Qwen3 layer, one token, INT4 g32 1.92
  // -> 1.28 ms, INT8 g32 2.78 -> 2.23 ms (the hardware prefetcher alone: 53-56% of the read
  // bandwidth); into L2 rather than L1, Q4_K GGUF x1.08-1.13 more (docs/engine.md).
  const int64_t ahead = prefetch_distance(gbytes);
  const int64_t stride = a.chunk_stride;
  const int8_t* x[kRows];
  const float* x_scale[kRows];
  const float* x_sum[kRows];
  float* out[kRows];
  for (int i = 0; i < kRows; ++i) {
    x[i] = a.rows[i0 + i], x_scale[i] = a.scale[i0 + i], x_sum[i] = a.scaled_sum[i0 + i];
    out[i] = c + (i0 + i) * ldc;
  }
  // Four activation bytes of row i at K-offset p (a multiple of 4) of the current step, broadcast.
  auto quad = [&](int i, int p) __attribute__((always_inline)) {
    const int8_t* at = x[i] + (p / kChunkBytes) * stride + p % kChunkBytes;
    return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(at));
  };
  const uint8_t* w = panel;
  int64_t gi = 0;
  for (int64_t k0 = 0; k0 < K; k0 += kStepK) {
#pragma GCC unroll 4
    for (int gs = 0; gs < kStepK / kGroup; ++gs, ++gi, w += gbytes) {
      for (int64_t off = 0; ahead > 0 && off < gbytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w) + ahead + off, _MM_HINT_T1);
      const int g0 = gs * kGroup;  // the group's first K-offset in the step
      __m256i d[kRows][2];
      for (int i = 0; i < kRows; ++i) d[i][0] = d[i][1] = _mm256_setzero_si256();
      // Adds the s16 pair sums p of row i to half h's int32 sums.
      auto add = [&](int i, int h, __m256i p) __attribute__((always_inline)) {
        d[i][h] = _mm256_add_epi32(d[i][h], _mm256_madd_epi16(p, ones));
      };
      auto load = [&](int64_t offset) __attribute__((always_inline)) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + offset));
      };
#pragma GCC unroll 32
      for (int r = 0; r < kPackedRows; ++r)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load(r * 64 + 32 * h);
          __m256i q[kParts<C>], magnitude[kParts<C>];
          for (int p = 0; p < kParts<C>; ++p) q[p] = codes.values(v, p), magnitude[p] = codes.magnitude(q[p]);
          for (int i = 0; i < kRows; ++i) {
            __m256i pairs = codes.pair_sums(magnitude[0], q[0], quad(i, g0 + part_k<C>(kGroup, r, 0)));
            for (int p = 1; p < kParts<C>; ++p)
              pairs = _mm256_add_epi16(
                  pairs, codes.pair_sums(magnitude[p], q[p], quad(i, g0 + part_k<C>(kGroup, r, p))));
            add(i, h, pairs);
          }
        }
      for (int h = 0; h < 2; ++h) {
        const auto [ws, wm] = D::template scales<Lanes>(w + wbytes, 8 * h);
        for (int i = 0; i < kRows; ++i) {
          __m256 sum = gi == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out[i] + 8 * h);
          sum = codes.plus_value_offset(sum, wm, _mm256_set1_ps(x_sum[i][gi]));
          _mm256_storeu_ps(out[i] + 8 * h,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[i][h]),
                                           _mm256_mul_ps(ws, _mm256_set1_ps(x_scale[i][gi])), sum));
        }
      }
    }
    for (int i = 0; i < kRows; ++i) x[i] += (kStepK / kChunkBytes) * stride;
  }
}

template <class D>
void gemm_q8(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
             int64_t ldc) {
  const int64_t stride = panel_bytes(D::kMethod, group, K);
  with_group(group, [&](auto group_size) {
    for_each_tile<kTileRows, 1>(m, npanels, [&](auto rows, auto, int i0, int p) {
      gemm_quant_tile<D, decltype(group_size)::value, decltype(rows)::value>(K, a, i0, panels + p * stride,
                                                                             c + p * kPanelWidth, ldc);
    });
  });
}

}  // namespace kt::kernels::avx2
