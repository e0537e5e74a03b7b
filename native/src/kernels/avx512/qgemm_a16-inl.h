// AVX-512 quantized weights x bf16 activations (decode): each packed weight widened to fp32 in
// registers, fp32 FMA with broadcast activations (widened once per call), the group's scale applied
// once per group. Byte j of lane n of a VNNI row r is channel n, K-value 4r + j (quant_types.h).
#pragma once

#include <immintrin.h>

#include <vector>

#include "../activations.h"
#include "../epilogue.h"

namespace kt::kernels::avx512 {

// Byte j of every 32-bit lane as fp32, sign-extended or not. Static: the AMX file includes it too.
template <int j, bool kSigned>
static inline __m512 lane_byte_ps(__m512i v) {
  if constexpr (kSigned) {
    const __m512i up = j == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * j);
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(up, 24));
  } else {
    const __m512i down = j == 0 ? v : _mm512_srli_epi32(v, 8 * j);
    return _mm512_cvtepi32_ps(j == 3 ? down : _mm512_and_si512(down, _mm512_set1_epi32(0xff)));
  }
}

// The four fp32 vectors of one VNNI row of weights (INT8: signed q; INT4: nibbles already split).
template <Method M>
static inline void widen_vnni_row(__m512i v, __m512 f[4]) {
  constexpr bool kSigned = M == Method::kInt8;
  if constexpr (kSigned) v = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));  // u - 128
  f[0] = lane_byte_ps<0, kSigned>(v);
  f[1] = lane_byte_ps<1, kSigned>(v);
  f[2] = lane_byte_ps<2, kSigned>(v);
  f[3] = lane_byte_ps<3, kSigned>(v);
}

// Calls body(v, r) for every VNNI row v of a group's weights as int8 rows: r is the row (K-values
// 4r .. 4r + 3 of the group). INT4 rows come from the low and high nibbles of one 64-byte row.
template <Method M, class F>
static inline void for_each_vnni_row(const uint8_t* w, int group, F&& body) {
  if constexpr (M == Method::kInt8) {
    for (int r = 0; r < group / 4; ++r) body(_mm512_loadu_si512(w + r * 64), r);
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const int half = group / 8;
    for (int r = 0; r < half; ++r) {
      const __m512i v = _mm512_loadu_si512(w + r * 64);
      body(_mm512_and_si512(v, nibble), r);
      body(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), r + half);
    }
  }
}

template <Method M, int kRows>
inline void gemm_a16_rows(int64_t K, int group, const float* const* h, const float* const* hsum,
                          const uint8_t* panel, float* const* out) {
  // One chain per K-value of a VNNI row for a single row (FMA latency), two for several.
  constexpr int kChains = kRows == 1 ? 4 : 2;
  const int64_t gbytes = group_bytes(M, group), wbytes = group_weight_bytes(M, group);
  __m512 acc[kRows];
  for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < K / group; ++gi) {
    const int64_t k0 = gi * group;
    const uint8_t* w = panel + gi * gbytes;
    const char* ahead = reinterpret_cast<const char*>(w) + 8 * gbytes;  // as in qgemm-inl.h
    for (int64_t off = 0; off < gbytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    __m512 d[kRows][kChains];
    for (int i = 0; i < kRows; ++i)
      for (int u = 0; u < kChains; ++u) d[i][u] = _mm512_setzero_ps();
    for_each_vnni_row<M>(w, group, [&](__m512i v, int r) {
      __m512 f[4];
      widen_vnni_row<M>(v, f);
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < kRows; ++i)
          d[i][j % kChains] = _mm512_fmadd_ps(f[j], _mm512_set1_ps(h[i][k0 + 4 * r + j]), d[i][j % kChains]);
    });
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + wbytes)));
    for (int i = 0; i < kRows; ++i) {
      __m512 dsum = d[i][0];
      for (int u = 1; u < kChains; ++u) dsum = _mm512_add_ps(dsum, d[i][u]);
      acc[i] = _mm512_fmadd_ps(dsum, ws, acc[i]);
      if constexpr (M == Method::kInt4) {
        const __m512 wm =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + wbytes + 32)));
        acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(hsum[i][gi]), acc[i]);
      }
    }
  }
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

template <Method M>
void gemm_quant_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                    float* c, int64_t ldc) {
  thread_local std::vector<float> hf, hs;
  if (hf.size() < static_cast<size_t>(m * K)) hf.resize(m * K);
  if (hs.size() < static_cast<size_t>(m * (K / group))) hs.resize(m * (K / group));
  for (int i = 0; i < m; ++i)
    bf16_row_to_float(a, i, K, group, hf.data() + i * K,
                      M == Method::kInt4 ? hs.data() + i * (K / group) : nullptr);
  const int64_t pbytes = panel_bytes(M, group, K);
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* panel = panels + p * pbytes;
    int i0 = 0;
    for (; i0 + 4 <= m; i0 += 4) {
      float* out[4];
      const float* h[4];
      const float* s[4];
      for (int i = 0; i < 4; ++i)
        out[i] = c + (i0 + i) * ldc + p * kPanelWidth, h[i] = hf.data() + (i0 + i) * K,
        s[i] = hs.data() + (i0 + i) * (K / group);
      gemm_a16_rows<M, 4>(K, group, h, s, panel, out);
    }
    for (; i0 < m; ++i0) {
      float* out[1] = {c + i0 * ldc + p * kPanelWidth};
      const float* h[1] = {hf.data() + i0 * K};
      const float* s[1] = {hs.data() + i0 * (K / group)};
      gemm_a16_rows<M, 1>(K, group, h, s, panel, out);
    }
  }
}

}  // namespace kt::kernels::avx512
