// Prefill for the nibble methods that read bf16 activations (RAWINT4, GPTQ_INT4, MXFP4, NVFP4), for
// experts of more rows than a pass of the A16 kernel serves. The int16 passes (qgemm_a16-inl.h) do
// half the work per instruction of the int8 tiles and an epilogue per group for each pass of 4 rows;
// here the codes are decoded to bf16 once per call, exactly, and read by bf16 tiles:
// - MXFP4, NVFP4: e2m1 value times its block scale (at most 6 significant bits) for the whole K of
//   each panel, then the BF16 tiles, with no epilogue at all (NVFP4's matrix scale multiplies the
//   panel's outputs in fp32);
// - RAWINT4, GPTQ_INT4: q - zero (-8..15) per K-chunk of a tile's panels, then tiles that multiply
//   each group's sums by its scale, as FP8's do (src/methods/fp8/avx512.cpp).
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "../tiles.h"
#include "kt/aligned_vector.h"
#include "kt/cpu_features.h"
#include "qgemm_a16-inl.h"

namespace kt::kernels::avx512 {

// Experts of more rows than this take the decoded tiles (Zen 4, Qwen3 MXFP4 calls of 2048 x 4
// panels: at 16 rows the int16 passes still win, the decode costing as much as they save).
inline constexpr int kDecodedMinRows = 17;

// The value of each nibble code: e2m1 for the FP4 methods, the integer itself for the others.
template <Method M>
inline __m512 code_values() {
  alignas(64) static constexpr float kE2m1[16] = {0,     0.5f,  1,  1.5f,  2,  3,  4,  6,
                                                  -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  alignas(64) static constexpr float kInt[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return _mm512_load_ps(kLookupNibbles<M> ? kE2m1 : kInt);
}

// One group of a panel's codes -> BF16 packed rows (16 channels x 2 K-values per 64 bytes) at `out`,
// each value table[code] * mul + add per channel, exact in bf16.
template <Method M, int kGroup>
inline void decode_group(const uint8_t* w, __m512 mul, __m512 add, uint16_t* out) {
  const __m512 table = code_values<M>();
  const __m512i nibble = _mm512_set1_epi32(0x0f);
  constexpr int half = kGroup / 8;  // rows of 4 K-values in each nibble half
  for (int r = 0; r < half; ++r) {
    const __m512i v = _mm512_loadu_si512(w + r * 64);  // lane n: channel n's 4 bytes
    for (int h = 0; h < 2; ++h) {                      // low nibbles: K 4r.., high: 4(r + half)..
      __m256i bf[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i code = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + 4 * h), nibble);
        const __m512 value = _mm512_fmadd_ps(_mm512_permutexvar_ps(code, table), mul, add);
        bf[j] = (__m256i)_mm512_cvtneps_pbh(value);
      }
      uint16_t* row = out + 2 * (r + h * half) * 32;  // the pair rows of K 4r', 4r' + 2
      for (int j = 0; j < 4; j += 2)
        _mm512_store_si512(row + (j / 2) * 32,
                           _mm512_or_si512(_mm512_cvtepu16_epi32(bf[j]),
                                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf[j + 1]), 16)));
    }
  }
}

// The channels' block scales of an FP4 group (e8m0, or e4m3 without the matrix scale).
template <Method M>
inline __m512 fp4_block_scales(const uint8_t* block) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
  if constexpr (M == Method::kMxfp4)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 23));
  return e4m3_to_ps(bytes);
}

template <Method M>
void gemm_fp4_decoded(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                      float* c, int64_t ldc) {
  const int64_t stride = panel_bytes(M, group, K), gbytes = group_bytes(M, group);
  const int64_t wbytes = group_weight_bytes(M, group), decoded_panel = K * kPanelWidth;  // bf16 values
  thread_local AlignedVector<uint16_t> decoded;
  if (decoded.size() < static_cast<size_t>(npanels * decoded_panel)) decoded.resize(npanels * decoded_panel);
  with_group(group, [&](auto group_size) {
    constexpr int kGroup = decltype(group_size)::value;
    for (int p = 0; p < npanels; ++p)
      for (int64_t gi = 0; gi < K / kGroup; ++gi) {
        const uint8_t* w = panels + p * stride + gi * gbytes;
        decode_group<M, kGroup>(w, fp4_block_scales<M>(w + wbytes), _mm512_setzero_ps(),
                                decoded.data() + p * decoded_panel + gi * kGroup * kPanelWidth);
      }
  });
  gemm_bf16(m, K, kKAlign, a, reinterpret_cast<const uint8_t*>(decoded.data()), npanels, c, ldc);
  if constexpr (M == Method::kNvfp4)
    for (int p = 0; p < npanels; ++p) {
      const __m512 g = _mm512_set1_ps(nvfp4_global(panels + p * stride + wbytes));
      for (int i = 0; i < m; ++i) {
        float* out = c + i * ldc + p * kPanelWidth;
        _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_loadu_ps(out), g));
      }
    }
}

// K-values decoded per step: 4 panels x 512 x 2 bytes = 64 KiB of bf16, read by every row tile.
inline constexpr int64_t kDecodedChunkK = 512;
inline constexpr int kDecodedTileRows = 6, kDecodedTilePanels = 4;

// Groups [g0, g1) of a tile of kRows x kPanels from the decoded rows `dec` (panel p's row r at
// dec + (p * kDecodedChunkK / 2 + r) * 32, r counted from group g0), adding each group's sums times
// its scales into C (g0 == 0 writes C first).
template <Method M, int kGroup, int kRows, int kPanels>
__attribute__((noinline)) void gemm_decoded_tile(const Bf16Rows& a, int i0, const uint16_t* dec,
                                                 const uint8_t* panel0, int64_t panel_stride, int64_t g0,
                                                 int64_t g1, float* c, int64_t ldc) {
  constexpr int64_t gbytes = group_bytes(M, kGroup), wbytes = group_weight_bytes(M, kGroup);
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
      const __m512 ws = group_scales<M>(panel0 + p * panel_stride + gi * gbytes + wbytes).first;
      for (int i = 0; i < kRows; ++i) {
        float* out = c + (i0 + i) * ldc + p * kPanelWidth;
        const __m512 sum = gi == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out);
        _mm512_storeu_ps(out, _mm512_fmadd_ps(acc[i][p], ws, sum));
      }
    }
  }
}

// RAWINT4 / GPTQ_INT4: q - zero per K-chunk of a tile's panels, the group's scale in the tile.
template <Method M>
void gemm_int4_decoded(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                       float* c, int64_t ldc) {
  const int64_t stride = panel_bytes(M, group, K), gbytes = group_bytes(M, group);
  const int64_t wbytes = group_weight_bytes(M, group);
  thread_local AlignedVector<uint16_t> decoded;
  const size_t need = static_cast<size_t>(kDecodedTilePanels * kDecodedChunkK * kPanelWidth);
  if (decoded.size() < need) decoded.resize(need);
  with_group(group, [&](auto group_size) {
    constexpr int kGroup = decltype(group_size)::value;
    for (int p0 = 0; p0 < npanels; p0 += kDecodedTilePanels)
      with_count<kDecodedTilePanels>(std::min(kDecodedTilePanels, npanels - p0), [&](auto tile_panels) {
        constexpr int kPanels = decltype(tile_panels)::value;
        const uint8_t* panel0 = panels + p0 * stride;
        for (int64_t k0 = 0; k0 < K; k0 += kDecodedChunkK) {
          const int64_t g0 = k0 / kGroup, g1 = std::min(K, k0 + kDecodedChunkK) / kGroup;
          for (int p = 0; p < kPanels; ++p)
            for (int64_t gi = g0; gi < g1; ++gi) {
              const uint8_t* w = panel0 + p * stride + gi * gbytes;
              // q - zero: RAWINT4's zero is 8, GPTQ's block stores -zero in fp16 after the scales
              const __m512 zero = M == Method::kRawInt4
                                      ? _mm512_set1_ps(-float{method_traits(M).weight_zero})
                                      : _mm512_cvtph_ps(_mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(w + wbytes + 32)));
              decode_group<M, kGroup>(
                  w, _mm512_set1_ps(1.0f), zero,
                  decoded.data() + (p * kDecodedChunkK / 2 + (gi - g0) * kGroup / 2) * 32);
            }
          for (int i0 = 0; i0 < m; i0 += kDecodedTileRows)
            with_count<kDecodedTileRows>(std::min(kDecodedTileRows, m - i0), [&](auto rows) {
              gemm_decoded_tile<M, kGroup, decltype(rows)::value, kPanels>(
                  a, i0, decoded.data(), panel0, stride, g0, g1, c + p0 * kPanelWidth, ldc);
            });
        }
      });
  });
}

// The A16 GEMM of the bf16-activation nibble methods: int16 passes for a few rows, decoded tiles for
// more (on CPUs with AVX-512 BF16).
template <Method M>
void gemm_nibbles_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                      float* c, int64_t ldc) {
  static_assert(kNibbles<M> && method_traits(M).gate_up_input == Activation::kBf16);
  static const bool has_bf16 = cpu_features().avx512_bf16;
  if (m < kDecodedMinRows || !has_bf16) return gemm_quant_a16<M>(m, K, group, a, panels, npanels, c, ldc);
  if constexpr (kLookupNibbles<M>)
    gemm_fp4_decoded<M>(m, K, group, a, panels, npanels, c, ldc);
  else
    gemm_int4_decoded<M>(m, K, group, a, panels, npanels, c, ldc);
}

}  // namespace kt::kernels::avx512
