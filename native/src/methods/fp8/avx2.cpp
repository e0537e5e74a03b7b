// AVX2 + FMA FP8: the bf16 products skeleton (../../kernels/avx2/bf16_products-inl.h) with e4m3
// widened to fp32 by shifts, each group's sums times its scales.
#include <immintrin.h>

#include <stdexcept>

#include "../../kernels/avx2/bf16_products-inl.h"
#include "fp8.h"

namespace kt::kernels::avx2 {

namespace {

constexpr int kGroup = fp8::kBlock;
constexpr int64_t kGroupBytes = group_bytes(Method::kFp8, kGroup);
constexpr int64_t kWeightBytes = group_weight_bytes(Method::kFp8, kGroup);

// The e4m3 byte in the top byte of each 32-bit lane -> fp32, exact: its exponent and mantissa
// shifted down by 4 read as value * 2^-120 (normals and subnormals alike), made whole by 2^120.
inline __m256 top_byte_to_float(__m256i t) {
  const __m256i mag = _mm256_srli_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0x7f000000)), 4);
  const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
  return _mm256_or_ps(
      v, _mm256_castsi256_ps(_mm256_and_si256(t, _mm256_set1_epi32(static_cast<int>(0x80000000u)))));
}

struct Fp8Weights {
  static constexpr int kGroup = fp8::kBlock;
  static constexpr int64_t group_bytes(int64_t) { return kGroupBytes; }
  void decode(const uint8_t* w, int64_t k, int j, __m256 even[2], __m256 odd[2]) const {
    // Row k/2 + j shares 64 bytes with its neighbour (fp8.h): its 8-byte pieces for channels
    // 8h..8h+7 sit in the two 16-byte lanes 2h and 2h + 1.
    const uint8_t* block = w + (k / 2 + j / 2 * 2) * 32;
    for (int h = 0; h < 2; ++h) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * h));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * h + 16));
      const __m256i pairs =
          _mm256_cvtepu16_epi32(j % 2 == 0 ? _mm_unpacklo_epi64(a, b) : _mm_unpackhi_epi64(a, b));
      even[h] = top_byte_to_float(_mm256_slli_epi32(pairs, 24));
      odd[h] = top_byte_to_float(_mm256_slli_epi32(pairs, 16));
    }
  }
  __m256 scale(const uint8_t* w, int h) const {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(w + kWeightBytes) + 8 * h);
  }
};

}  // namespace

void gemm_fp8(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  if (group != kGroup) throw std::invalid_argument("FP8 kernels take groups of 128");
  gemm_bf16_products(Fp8Weights{}, m, K, a, panels, npanels, panel_bytes(Method::kFp8, kGroup, K), c, ldc);
}

}  // namespace kt::kernels::avx2
