// The e2m1 methods (MXFP4, NVFP4) with more rows than a pass of the A16 kernel serves: each panel's
// codes are decoded once per call into BF16's packed layout, exactly (an e2m1 value times its block
// scale has at most 6 significant bits; NVFP4's matrix scale stays out and multiplies the panel's
// outputs in fp32), then the BF16 tiles run without any per-group epilogue. The int16 passes
// (qgemm_a16-inl.h) do half the work per instruction of the int8 tiles and an epilogue per group of
// 16 or 32; the BF16 tiles reach three quarters of AMXINT4's prefill on Zen 4.
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "kt/aligned_vector.h"
#include "kt/cpu_features.h"
#include "qgemm_a16-inl.h"

namespace kt::kernels::avx512 {

// Experts of more rows than this take the decoded BF16 tiles (Zen 4, Qwen3 MXFP4 calls of 2048 x
// 4 panels: at 16 rows the int16 passes still win, the decode costing as much as they save).
inline constexpr int kFp4PassRows = 16;

// One group of panel codes -> BF16 packed rows (16 channels x 2 K-values per 64 bytes), with the
// channels' block scales (ws: fp32, exact) folded in.
template <Method M, int kGroup>
inline void decode_fp4_group(const uint8_t* w, __m512 ws, uint16_t* out) {
  alignas(64) static const float kValues[16] = {0,     0.5f,  1,  1.5f,  2,  3,  4,  6,
                                                -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  const __m512 table = _mm512_load_ps(kValues);
  const __m512i nibble = _mm512_set1_epi32(0x0f);
  constexpr int half = kGroup / 8;  // rows of 4 K-values in each nibble half
  for (int r = 0; r < half; ++r) {
    const __m512i v = _mm512_loadu_si512(w + r * 64);  // lane n: channel n's 4 bytes
    for (int h = 0; h < 2; ++h) {                      // low nibbles: K 4r.., high: 4(r + half)..
      __m256i bf[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i code = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + 4 * h), nibble);
        bf[j] = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutexvar_ps(code, table), ws));
      }
      uint16_t* row = out + (4 * (r + h * half) / 2) * 32;  // pair rows of K 4r', 4r' + 2
      for (int j = 0; j < 4; j += 2) {
        const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(bf[j]),
                                             _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf[j + 1]), 16));
        _mm512_store_si512(row + (j / 2) * 32, pair);
      }
    }
  }
}

// The channels' block scales of one group, without the A16 kernels' halving.
template <Method M>
inline __m512 fp4_block_scales(const uint8_t* block) {
  if constexpr (M == Method::kMxfp4) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  } else {
    return e4m3_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
  }
}

template <Method M>
void gemm_fp4(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  static_assert(kLookupNibbles<M>, "the e2m1 methods only");
  static const bool has_bf16 = cpu_features().avx512_bf16;
  if (m <= kFp4PassRows || !has_bf16) return gemm_quant_a16<M>(m, K, group, a, panels, npanels, c, ldc);
  const int64_t stride = panel_bytes(M, group, K), gbytes = group_bytes(M, group);
  const int64_t wbytes = group_weight_bytes(M, group), decoded_panel = K * kPanelWidth;  // bf16 values
  thread_local AlignedVector<uint16_t> decoded;
  if (decoded.size() < static_cast<size_t>(npanels * decoded_panel)) decoded.resize(npanels * decoded_panel);
  with_group(group, [&](auto group_size) {
    constexpr int kGroup = decltype(group_size)::value;
    for (int p = 0; p < npanels; ++p)
      for (int64_t gi = 0; gi < K / kGroup; ++gi) {
        const uint8_t* w = panels + p * stride + gi * gbytes;
        decode_fp4_group<M, kGroup>(w, fp4_block_scales<M>(w + wbytes),
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

}  // namespace kt::kernels::avx512
