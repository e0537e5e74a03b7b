// AVX2 + FMA FP8 GEMM: e4m3 widened to fp32 by shifts, fp32 FMA, on tiles of up to 4 rows x one
// panel (two halves of 8 channels), the weights decoded once per tile for all of its rows.
#include <immintrin.h>

#include <stdexcept>

#include "../../kernels/activations.h"
#include "../../kernels/tiles.h"
#include "fp8.h"

namespace kt::kernels::avx2 {

namespace {

constexpr int kGroup = fp8::kBlock;
constexpr int64_t kGroupBytes = group_bytes(Method::kFp8, kGroup);
constexpr int64_t kWeightBytes = group_weight_bytes(Method::kFp8, kGroup);
constexpr int kRows = 4;

// The e4m3 byte in the top byte of each 32-bit lane -> fp32, exact: its exponent and mantissa
// shifted down by 4 read as value * 2^-120 (normals and subnormals alike), made whole by 2^120.
inline __m256 top_byte_to_float(__m256i t) {
  const __m256i mag = _mm256_srli_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0x7f000000)), 4);
  const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
  return _mm256_or_ps(
      v, _mm256_castsi256_ps(_mm256_and_si256(t, _mm256_set1_epi32(static_cast<int>(0x80000000u)))));
}

template <int kTileRows>
void gemm_fp8_tile(int64_t K, const Bf16Rows& a, int i0, const uint8_t* panel, float* c, int64_t ldc) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t gi = 0; gi < K / kGroup; ++gi) {
    const uint8_t* w = panel + gi * kGroupBytes;
    __m256 acc[kTileRows][2];
    for (int i = 0; i < kTileRows; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int k = 0; k < kGroup; k += 32) {  // one 64-byte chunk of each row: 16 K-pairs
      const int32_t* x[kTileRows];
      for (int i = 0; i < kTileRows; ++i)
        x[i] = reinterpret_cast<const int32_t*>(bf16_at(a, i0 + i, gi * kGroup + k));
      for (int j = 0; j < 16; ++j) {
        // Row k/2 + j shares 64 bytes with its neighbour (fp8.h): its 8-byte pieces for channels
        // 8h..8h+7 sit in the two 16-byte lanes 2h and 2h + 1.
        const uint8_t* block = w + (k / 2 + j / 2 * 2) * 32;
        __m256 even[2], odd[2];  // channels 8h..8h+7: their K-values 2j and 2j + 1
        for (int h = 0; h < 2; ++h) {
          const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * h));
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * h + 16));
          const __m256i pairs =
              _mm256_cvtepu16_epi32(j % 2 == 0 ? _mm_unpacklo_epi64(a, b) : _mm_unpackhi_epi64(a, b));
          even[h] = top_byte_to_float(_mm256_slli_epi32(pairs, 24));
          odd[h] = top_byte_to_float(_mm256_slli_epi32(pairs, 16));
        }
        for (int i = 0; i < kTileRows; ++i) {
          const __m256i pair = _mm256_set1_epi32(x[i][j]);
          const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
          const __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
          for (int h = 0; h < 2; ++h)
            acc[i][h] = _mm256_fmadd_ps(odd[h], a1, _mm256_fmadd_ps(even[h], a0, acc[i][h]));
        }
      }
    }
    // The sums of earlier groups live in C: in registers they would not leave room for the weights.
    const auto* scale = reinterpret_cast<const float*>(w + kWeightBytes);
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(scale + 8 * h);
      for (int i = 0; i < kTileRows; ++i) {
        float* out = c + (i0 + i) * ldc + 8 * h;
        const __m256 sum = gi == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out);
        _mm256_storeu_ps(out, _mm256_fmadd_ps(acc[i][h], s, sum));
      }
    }
  }
}

}  // namespace

void gemm_fp8(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  if (group != kGroup) throw std::invalid_argument("FP8 kernels take groups of 128");
  const int64_t stride = panel_bytes(Method::kFp8, kGroup, K);
  for_each_tile<kRows, 1>(m, npanels, [&](auto rows, auto, int i0, int p) {
    gemm_fp8_tile<decltype(rows)::value>(K, a, i0, panels + p * stride, c + p * kPanelWidth, ldc);
  });
}

}  // namespace kt::kernels::avx2
