// AVX2 quantized weights x bf16 activations: the AVX-512 A16 scheme on 8-channel halves of a
// panel, one row of A per pass (see ../avx512/qgemm_a16-inl.h).
#pragma once

#include <immintrin.h>

#include <vector>

#include "../activations.h"
#include "../epilogue.h"

namespace kt::kernels::avx2 {

// Byte j of every 32-bit lane as fp32, sign-extended or not.
template <int j, bool kSigned>
inline __m256 lane_byte_ps(__m256i v) {
  if constexpr (kSigned) {
    const __m256i up = j == 3 ? v : _mm256_slli_epi32(v, 24 - 8 * j);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(up, 24));
  } else {
    const __m256i down = j == 0 ? v : _mm256_srli_epi32(v, 8 * j);
    return _mm256_cvtepi32_ps(j == 3 ? down : _mm256_and_si256(down, _mm256_set1_epi32(0xff)));
  }
}

template <Method M>
void gemm_quant_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                    float* c, int64_t ldc) {
  constexpr bool kSigned = M == Method::kInt8;
  const int64_t pbytes = panel_bytes(M, group, K);
  const int64_t gbytes = group_bytes(M, group), wbytes = group_weight_bytes(M, group);
  const __m256i nibble = _mm256_set1_epi8(0x0f), sign = _mm256_set1_epi8(static_cast<char>(0x80));
  thread_local std::vector<float> hf, hs;
  if (hf.size() < static_cast<size_t>(K)) hf.resize(K);
  if (hs.size() < static_cast<size_t>(K / group)) hs.resize(K / group);
  for (int i = 0; i < m; ++i) {
    bf16_row_to_float(a, i, K, group, hf.data(), hs.data());
    for (int p = 0; p < npanels; ++p) {
      const uint8_t* panel = panels + p * pbytes;
      for (int half = 0; half < 2; ++half) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t gi = 0; gi < K / group; ++gi) {
          const uint8_t* w = panel + gi * gbytes;
          const float* h = hf.data() + gi * group;
          __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
          auto row = [&](__m256i v, int r) {  // VNNI row r of the group: K-values 4r .. 4r + 3
            if constexpr (kSigned) v = _mm256_xor_si256(v, sign);
            d[0] = _mm256_fmadd_ps(lane_byte_ps<0, kSigned>(v), _mm256_set1_ps(h[4 * r]), d[0]);
            d[1] = _mm256_fmadd_ps(lane_byte_ps<1, kSigned>(v), _mm256_set1_ps(h[4 * r + 1]), d[1]);
            d[0] = _mm256_fmadd_ps(lane_byte_ps<2, kSigned>(v), _mm256_set1_ps(h[4 * r + 2]), d[0]);
            d[1] = _mm256_fmadd_ps(lane_byte_ps<3, kSigned>(v), _mm256_set1_ps(h[4 * r + 3]), d[1]);
          };
          if constexpr (M == Method::kInt8) {
            for (int r = 0; r < group / 4; ++r)
              row(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * 64 + half * 32)), r);
          } else {
            const int rows = group / 8;
            for (int r = 0; r < rows; ++r) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * 64 + half * 32));
              row(_mm256_and_si256(v, nibble), r);
              row(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), r + rows);
            }
          }
          const __m256 ws =
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + wbytes + 16 * half)));
          acc = _mm256_fmadd_ps(_mm256_add_ps(d[0], d[1]), ws, acc);
          if constexpr (M == Method::kInt4) {
            const __m256 wm = _mm256_cvtph_ps(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + wbytes + 32 + 16 * half)));
            acc = _mm256_fmadd_ps(wm, _mm256_set1_ps(hs[gi]), acc);
          }
        }
        _mm256_storeu_ps(c + i * ldc + p * kPanelWidth + 8 * half, acc);
      }
    }
  }
}

}  // namespace kt::kernels::avx2
