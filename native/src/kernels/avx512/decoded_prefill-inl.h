// The A16 GEMM of every decoded method (gemm_a16 below), and the prefill of the nibble methods that
// read bf16 activations (RAWINT4, GPTQ_INT4, MXFP4, NVFP4) for experts of more rows than a pass of
// the A16 kernel serves. The int16 passes (qgemm_a16-inl.h) do
// half the work per instruction of the int8 tiles and an epilogue per group for each pass of 4 rows;
// here the codes are decoded to bf16 once per call, exactly, and read by bf16 tiles:
// - MXFP4, NVFP4: e2m1 value times its block scale (at most 6 significant bits) for the whole K of
//   each panel, then the BF16 tiles, with no epilogue at all (NVFP4's matrix scale multiplies the
//   panel's outputs in fp32);
// - RAWINT4, GPTQ_INT4: q - zero (-8..15) per K-chunk of a tile's panels, then tiles that multiply
//   each group's sums by its scale, as FP8's do (decoded_tiles-inl.h).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../tiles.h"
#include "decoded_tiles-inl.h"
#include "kt/aligned_vector.h"
#include "kt/cpu_features.h"
#include "qgemm_a16-inl.h"

namespace kt::kernels::avx512 {

// Experts of more rows than this take the decoded tiles (Zen 4, Qwen3 MXFP4 calls of 2048 x 4
// panels: at 16 rows the int16 passes still win, the decode costing as much as they save).
inline constexpr int kDecodedMinRows = 17;

// One group of a panel's codes -> BF16 packed rows (16 channels x 2 K-values per 64 bytes) at `out`,
// each value (the code's value in the decoded prefill, ../codes.h) * mul + add per channel, exact in
// bf16.
template <class D, int kGroup>
inline void decode_group(const uint8_t* w, __m512 mul, __m512 add, uint16_t* out) {
  using C = typename D::Codes;
  const CodeLanes<C> codes;
  constexpr int rows = packed_rows<C>(kGroup);
  for (int r = 0; r < rows; ++r) {
    const __m512i v = _mm512_loadu_si512(w + r * 64);  // lane n: channel n's 4 bytes
    for (int h = 0; h < kParts<C>; ++h) {              // part h: K-row part_row(rows, r, h)
      __m256i bf[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i code = codes.lane_code(v, 8 * j + C::kBits * h);
        const __m512 value = _mm512_fmadd_ps(codes.lane_decoded(code), mul, add);
        bf[j] = (__m256i)_mm512_cvtneps_pbh(value);
      }
      uint16_t* row = out + 2 * part_row(rows, r, h) * 32;  // the pair rows of K 4r', 4r' + 2
      for (int j = 0; j < 4; j += 2)
        _mm512_store_si512(row + (j / 2) * 32,
                           _mm512_or_si512(_mm512_cvtepu16_epi32(bf[j]),
                                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf[j + 1]), 16)));
    }
  }
}

template <class D>
void gemm_fp4_decoded(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                      float* c, int64_t ldc) {
  const int64_t stride = panel_bytes(D::kMethod, group, K), gbytes = group_bytes(D::kMethod, group);
  const int64_t wbytes = group_weight_bytes(D::kMethod, group),
                decoded_panel = K * kPanelWidth;  // bf16 values
  thread_local AlignedVector<uint16_t> decoded;
  if (decoded.size() < static_cast<size_t>(npanels * decoded_panel)) decoded.resize(npanels * decoded_panel);
  with_group(group, [&](auto group_size) {
    constexpr int kGroup = decltype(group_size)::value;
    for (int p = 0; p < npanels; ++p)
      for (int64_t gi = 0; gi < K / kGroup; ++gi) {
        const uint8_t* w = panels + p * stride + gi * gbytes;
        decode_group<D, kGroup>(w, D::template block_scales<Lanes>(w + wbytes, 0), _mm512_setzero_ps(),
                                decoded.data() + p * decoded_panel + gi * kGroup * kPanelWidth);
      }
  });
  gemm_bf16(m, K, kKAlign, a, reinterpret_cast<const uint8_t*>(decoded.data()), npanels, c, ldc);
  if constexpr (D::kMatrixScale)
    for (int p = 0; p < npanels; ++p) {
      const __m512 g = _mm512_set1_ps(D::matrix_scale(panels + p * stride + wbytes));
      for (int i = 0; i < m; ++i) {
        float* out = c + i * ldc + p * kPanelWidth;
        _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_loadu_ps(out), g));
      }
    }
}

// RAWINT4 / GPTQ_INT4: q - zero per K-chunk of a tile's panels (decoded_tiles-inl.h), each group's
// sums times its scale.
template <class D>
void gemm_int4_decoded(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                       float* c, int64_t ldc) {
  const int64_t stride = panel_bytes(D::kMethod, group, K), gbytes = group_bytes(D::kMethod, group);
  const int64_t wbytes = group_weight_bytes(D::kMethod, group);
  with_group(group, [&](auto group_size) {
    constexpr int kGroup = decltype(group_size)::value;
    const auto decode = [&](const uint8_t* panel, int64_t gi, uint16_t* out) {
      const uint8_t* w = panel + gi * gbytes;
      decode_group<D, kGroup>(w, _mm512_set1_ps(1.0f), D::template zero_points<Lanes>(w + wbytes, 0), out);
    };
    const auto scale = [&](const uint8_t* panel, int64_t gi) {
      return D::template scales<Lanes>(panel + gi * gbytes + wbytes, 0).first;
    };
    gemm_decoded<kGroup>(m, K, a, panels, npanels, stride, c, ldc, decode, scale);
  });
}

// The A16 GEMM of every decoded method: the int16 passes, and for the nibble methods that read
// bf16 activations only, the decoded tiles from kDecodedMinRows rows (on CPUs with AVX-512 BF16):
// q - zero where the decoder has zero points, else code value times its block scale.
template <class D>
void gemm_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  if constexpr (method_traits(D::kMethod).gate_up_input != Activation::kBf16) {
    gemm_quant_a16<D>(m, K, group, a, panels, npanels, c, ldc);
  } else {
    static const bool has_bf16 = cpu_features().avx512_bf16;
    if (m < kDecodedMinRows || !has_bf16) return gemm_quant_a16<D>(m, K, group, a, panels, npanels, c, ldc);
    if constexpr (requires { D::template zero_points<Lanes>(nullptr, 0); })
      gemm_int4_decoded<D>(m, K, group, a, panels, npanels, c, ldc);
    else
      gemm_fp4_decoded<D>(m, K, group, a, panels, npanels, c, ldc);
  }
}

}  // namespace kt::kernels::avx512
