// AMX quantized weights x bf16 activations (prefill): each pair of panels is dequantized once per
// call into the BF16 panel layout (w = ws * q, or ws * u + wm for INT4, rounded to bf16), then runs
// through the tdpbf16ps kernel: no per-group epilogue, so AMX, not the vector unit, sets the pace.
// Small batches go to the AVX-512 VNNI kernel, which reads the packed weights directly.
#pragma once

#include <vector>

#include "../epilogue.h"
#include "kt/aligned_vector.h"
#include "tile_config.h"

namespace kt::kernels::amx {

// Byte j of every 32-bit lane as fp32, sign-extended or not.
template <int j, bool kSigned>
inline __m512 lane_byte_ps(__m512i v) {
  if constexpr (kSigned) {
    const __m512i up = j == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * j);
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(up, 24));
  } else {
    const __m512i down = j == 0 ? v : _mm512_srli_epi32(v, 8 * j);
    return _mm512_cvtepi32_ps(j == 3 ? down : _mm512_and_si512(down, _mm512_set1_epi32(0xff)));
  }
}

// The weights of one VNNI row (byte j of lane n: channel n, K-value 4r + j) as four fp32 vectors,
// K-value by K-value: INT8 as signed q = u - 128, INT4 nibbles as they are.
template <Method M>
inline void widen_vnni_row(__m512i v, __m512 f[4]) {
  constexpr bool kSigned = M == Method::kInt8;
  if constexpr (kSigned) v = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  f[0] = lane_byte_ps<0, kSigned>(v);
  f[1] = lane_byte_ps<1, kSigned>(v);
  f[2] = lane_byte_ps<2, kSigned>(v);
  f[3] = lane_byte_ps<3, kSigned>(v);
}

// Calls body(v, r) for every VNNI row of a group's weights as a row of bytes: r is its row in the
// group (K-values 4r .. 4r + 3). INT4 rows come from the low and high nibbles of one 64-byte row.
template <Method M, class F>
inline void for_each_vnni_row(const uint8_t* w, int group, F&& body) {
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

// Two fp32 vectors of 16 channels -> one BF16 VNNI row: lane n holds (bf16(lo[n]), bf16(hi[n])).
inline __m512i bf16_pair_row(__m512 lo, __m512 hi) {
  alignas(64) static const uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                       21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo in lanes 0-15
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), halves);
}

// One packed INT8/INT4 panel over K -> the BF16 panel layout (K / 2 rows of 64 bytes).
template <Method M>
void dequantize_panel(const uint8_t* panel, int64_t K, int group, uint8_t* out) {
  const int64_t gbytes = group_bytes(M, group), wbytes = group_weight_bytes(M, group);
  for (int64_t gi = 0; gi < K / group; ++gi) {
    const uint8_t* w = panel + gi * gbytes;
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + wbytes)));
    const __m512 wm =
        M == Method::kInt4
            ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + wbytes + 32)))
            : _mm512_setzero_ps();
    uint8_t* dst = out + gi * group / 2 * 64;
    for_each_vnni_row<M>(w, group, [&](__m512i v, int r) {
      __m512 f[4];
      widen_vnni_row<M>(v, f);
      for (int j = 0; j < 4; ++j) f[j] = _mm512_fmadd_ps(f[j], ws, wm);
      _mm512_storeu_si512(dst + (2 * r) * 64, bf16_pair_row(f[0], f[1]));
      _mm512_storeu_si512(dst + (2 * r + 1) * 64, bf16_pair_row(f[2], f[3]));
    });
  }
}

template <Method M>
void gemm_quant_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                    float* c, int64_t ldc, GemmQuantA16Fn small) {
  if (m <= 4) return small(m, K, group, a, panels, npanels, c, ldc);
  const int64_t pbytes = panel_bytes(M, group, K), bf16_bytes = panel_bytes(Method::kBf16, kKAlign, K);
  thread_local AlignedVector<uint8_t> pair;
  if (pair.size() < static_cast<size_t>(2 * bf16_bytes)) pair.resize(2 * bf16_bytes);
  for (int p = 0; p < npanels; p += 2) {
    const int n = std::min(2, npanels - p);
    for (int j = 0; j < n; ++j)
      dequantize_panel<M>(panels + (p + j) * pbytes, K, group, pair.data() + j * bf16_bytes);
    gemm_bf16(m, K, a, pair.data(), n, c + p * kPanelWidth, ldc);
  }
}

}  // namespace kt::kernels::amx
