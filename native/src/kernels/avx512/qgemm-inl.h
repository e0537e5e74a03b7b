// AVX-512 VNNI quantized GEMM (the integer methods): vpdpbusd of packed u8 weights with broadcast s8
// activations and the group epilogue of ../epilogue.h. Decode: up to 4 rows of A per pass over one
// panel; prefill: tiles of rows x panels (row_blocks-inl.h).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <utility>

#include "../activations.h"
#include "../epilogue.h"
#include "codes-inl.h"
#include "lanes.h"
#include "row_blocks-inl.h"

namespace kt::kernels::avx512 {

// kRows rows of one panel per pass (decode).
template <class D, int kGroup, int kRows>
inline void gemm_quant_rows(int64_t K, const QuantRows& a, int i0, const uint8_t* panel, float* const* out) {
  using C = typename D::Codes;
  constexpr int kPackedRows = packed_rows<C>(kGroup);  // a constant: GCC ignores unroll pragmas on a call
  // Independent accumulators per row: vpdpbusd has a latency of several cycles, and one chain per
  // row would bound a single-row (decode) pass to ~13 GB/s per core.
  constexpr int kChains = kRows == 1 ? 4 : 2;
  constexpr int64_t gbytes = group_bytes(D::kMethod, kGroup), wbytes = group_weight_bytes(D::kMethod, kGroup);
  // A step is one chunk of activations (64 K-values) or one group of several chunks, so every
  // activation offset inside it is known at compile time and the row pointers stay in registers:
  // computed per group they cost 30 of the loop's 75 instructions a group, and the loop is
  // memory-bound, so each saved instruction keeps more of the stream in flight (Qwen3 layer, Q4_K
  // GGUF, one token, Emerald Rapids: x1.03-1.05).
  constexpr int kStepK = kGroup > kChunkBytes ? kGroup : kChunkBytes;
  const int64_t ahead_bytes = prefetch_distance(gbytes);
  const int64_t stride = a.chunk_stride;
  const CodeLanes<C> codes;
  const int8_t* x[kRows];
  const float* x_scale[kRows];
  const float* x_sum[kRows];
  __m512 acc[kRows];
  for (int i = 0; i < kRows; ++i) {
    x[i] = a.rows[i0 + i], x_scale[i] = a.scale[i0 + i], x_sum[i] = a.scaled_sum[i0 + i];
    acc[i] = _mm512_setzero_ps();
  }
  // Four activation bytes at K-offset p (a multiple of 4) of the current step, broadcast.
  auto quad = [&](int i, int p) __attribute__((always_inline)) {
    const int8_t* at = x[i] + (p / kChunkBytes) * stride + p % kChunkBytes;
    return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(at));
  };
  const uint8_t* w = panel;
  int64_t gi = 0;
  for (int64_t k0 = 0; k0 < K; k0 += kStepK) {
#pragma GCC unroll 4
    for (int gs = 0; gs < kStepK / kGroup; ++gs, ++gi, w += gbytes) {
      const char* ahead = reinterpret_cast<const char*>(w) + ahead_bytes;
      // Into L2, not L1 (see prefetch_distance): with prefetcht0 this loop stalled on the prefetches
      // themselves (70% of its samples at one token), which wait for L1's few fill buffers.
      for (int64_t off = 0; ahead_bytes > 0 && off < gbytes; off += 64)
        _mm_prefetch(ahead + off, _MM_HINT_T1);
      const int g0 = gs * kGroup;  // the group's first K-offset in the step
      __m512i d[kRows][kChains];
      for (int i = 0; i < kRows; ++i)
        for (int u = 0; u < kChains; ++u) d[i][u] = _mm512_setzero_si512();
      // Each part of a packed row (its codes' K-range, ../codes.h) goes to a chain of its own.
      constexpr int kRowsPerStep = kChains / kParts<C>;
#pragma GCC unroll 32
      for (int r = 0; r < kPackedRows; r += kRowsPerStep)
        for (int u = 0; u < kRowsPerStep; ++u) {
          const __m512i v = _mm512_loadu_si512(w + (r + u) * 64);
          __m512i part[kParts<C>];
          for (int p = 0; p < kParts<C>; ++p) part[p] = codes.codes(v, p);
          for (int i = 0; i < kRows; ++i)
            for (int p = 0; p < kParts<C>; ++p) {
              __m512i& chain = d[i][kParts<C> * u + p];
              chain = _mm512_dpbusd_epi32(chain, part[p], quad(i, g0 + part_k<C>(kGroup, r + u, p)));
            }
        }
      const auto [ws, wm] = D::template scales<Lanes>(w + wbytes, 0);
      for (int i = 0; i < kRows; ++i) {
        __m512i dsum = d[i][0];
        for (int u = 1; u < kChains; ++u) dsum = _mm512_add_epi32(dsum, d[i][u]);
        const __m512 t = _mm512_mul_ps(wm, _mm512_set1_ps(x_sum[i][gi]));
        acc[i] = _mm512_add_ps(acc[i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(dsum),
                                                       _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[i][gi])), t));
      }
    }
    for (int i = 0; i < kRows; ++i) x[i] += (kStepK / kChunkBytes) * stride;
  }
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

// C[i0 + i][16 (p0 + p) + j] for a tile of kRows x kPanels, all of its int32 group sums in
// registers. The fp32 sums live in C itself (written after the first group, then read and added):
// with the int32 sums they would not fit in 32 registers, and they move once per group. Never inlined:
// inlined into gemm_q8, the tile's code followed GCC's choices for the whole dispatcher, and a
// change to the decode loop alone made INT4 prefill 20-25% slower (Qwen3, 512 tokens); one call
// per tile costs nothing next to its loop over K.
template <class D, int kGroup, int kRows, int kPanels>
__attribute__((noinline)) void gemm_quant_tile(int64_t K, const QuantRows& a, int i0, const uint8_t* panel0,
                                               int64_t panel_stride, float* c, int64_t ldc) {
  using C = typename D::Codes;
  constexpr int kPackedRows = packed_rows<C>(kGroup);  // a constant: GCC ignores unroll pragmas on a call
  constexpr int64_t gbytes = group_bytes(D::kMethod, kGroup), wbytes = group_weight_bytes(D::kMethod, kGroup);
  // Steps of one chunk or one group, as in the decode pass: activation offsets known at compile time
  // (Qwen3 layer, 2 threads, Emerald Rapids, groups of 64: AMXINT4 x1.07-1.09 at 128-2,048 rows,
  // AMXINT8 x1.11-1.12 at 512-2,048).
  constexpr int kStepK = kGroup > kChunkBytes ? kGroup : kChunkBytes;
  const int64_t stride = a.chunk_stride;
  const CodeLanes<C> codes;
  const int8_t* x[kRows];
  const float* x_scale[kRows];
  const float* x_sum[kRows];
  float* out[kRows];
  for (int i = 0; i < kRows; ++i) {
    x[i] = a.rows[i0 + i], x_scale[i] = a.scale[i0 + i], x_sum[i] = a.scaled_sum[i0 + i];
    out[i] = c + (i0 + i) * ldc;
  }
  // Four activation bytes of row i at K-offset k (a multiple of 4) of the current step, broadcast.
  auto quad = [&](int i, int k) __attribute__((always_inline)) {
    const int8_t* at = x[i] + (k / kChunkBytes) * stride + k % kChunkBytes;
    return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(at));
  };
  const uint8_t* w[kPanels];
  for (int p = 0; p < kPanels; ++p) w[p] = panel0 + p * panel_stride;
  int64_t gi = 0;
  for (int64_t k0 = 0; k0 < K; k0 += kStepK) {
    for (int gs = 0; gs < kStepK / kGroup; ++gs, ++gi) {
      const int g0 = gs * kGroup;  // the group's first K-offset in the step
      __m512i d[kRows][kPanels];
      for (int i = 0; i < kRows; ++i)
        for (int p = 0; p < kPanels; ++p) d[i][p] = _mm512_setzero_si512();
      // Adds the weight vectors wv (4 K-values per channel) times each row's 4 activations at k.
      auto dot = [&](const __m512i* wv, int k) __attribute__((always_inline)) {
        for (int i = 0; i < kRows; ++i) {
          const __m512i xv = quad(i, k);
          for (int p = 0; p < kPanels; ++p) d[i][p] = _mm512_dpbusd_epi32(d[i][p], wv[p], xv);
        }
      };
#pragma GCC unroll 32
      for (int r = 0; r < kPackedRows; ++r)
        for (int part = 0; part < kParts<C>; ++part) {
          __m512i wv[kPanels];
          for (int p = 0; p < kPanels; ++p) wv[p] = codes.codes(_mm512_loadu_si512(w[p] + r * 64), part);
          dot(wv, g0 + part_k<C>(kGroup, r, part));
        }
      for (int p = 0; p < kPanels; ++p) {
        const auto [ws, wm] = D::template scales<Lanes>(w[p] + wbytes, 0);
        for (int i = 0; i < kRows; ++i) {
          float* o = out[i] + p * kPanelWidth;
          const __m512 sum = gi == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
          const __m512 t = _mm512_fmadd_ps(wm, _mm512_set1_ps(x_sum[i][gi]), sum);
          _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[i][p]),
                                              _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[i][gi])), t));
        }
        w[p] += gbytes;
      }
    }
    for (int i = 0; i < kRows; ++i) x[i] += (kStepK / kChunkBytes) * stride;
  }
}

// Up to 8 rows, passes of one panel (blocks of 4 and the rest) beat the 4 x 2 tiles: they prefetch
// and keep more chains per row (Zen 4, Qwen3 experts of m rows: m = 5-8 INT8 x1.01-1.31, INT4
// x1.00-1.46; at 12 rows x0.68 and x0.86).
inline constexpr int kMaxRowBlockRows = 8;

template <class D>
void gemm_q8(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
             int64_t ldc) {
  const int64_t stride = panel_bytes(D::kMethod, group, K);
  with_group(group, [&](auto group_size) {
    constexpr int kGroup = decltype(group_size)::value;
    if (m > kMaxRowBlockRows) {
      // 4 x 2 measured best on Zen 4 (m = 32-256, K = 2048 and 7168: INT8 x1.11-1.22, INT4
      // x0.98-1.03 over the decode blocks; 6 x 4 and 4 x 4 lost up to x0.6 for INT4).
      for_each_tile<4, 2>(m, npanels, [&](auto rows, auto tile_panels, int i0, int p0) {
        gemm_quant_tile<D, kGroup, decltype(rows)::value, decltype(tile_panels)::value>(
            K, a, i0, panels + p0 * stride, stride, c + p0 * kPanelWidth, ldc);
      });
      return;
    }
    for_each_row_block(m, panels, npanels, stride, c, ldc,
                       [&](auto rows, int i0, const uint8_t* panel, float* const* out) {
                         gemm_quant_rows<D, kGroup, decltype(rows)::value>(K, a, i0, panel, out);
                       });
  });
}

}  // namespace kt::kernels::avx512
