// AVX2 + FMA FP8: the bf16 products skeleton (../../kernels/avx2/bf16_products-inl.h) with e4m3
// widened to fp16 by a shift and a mask, then to fp32 by F16C, each group's sums times its scales.
#include <immintrin.h>

#include <cstdint>
#include <stdexcept>

#include "../../kernels/avx2/bf16_products-inl.h"
#include "fp8.h"

namespace kt::kernels::avx2 {

namespace {

constexpr int kGroup = fp8::kBlock;
constexpr int64_t kGroupBytes = group_bytes(Method::kFp8, kGroup);
constexpr int64_t kWeightBytes = group_weight_bytes(Method::kFp8, kGroup);

// 8 channels' e4m3 bytes in the high byte of each 16-bit lane -> fp16 of value * 2^-8, exact:
// sign in place, the 4-bit exponent and 3-bit mantissa one bit lower read as a 5-bit exponent (bias
// 15 for e4m3's 7) and the top of fp16's mantissa; subnormals land on fp16 subnormals alike. The
// group's scales carry the 2^8. Building fp32 by shifts instead was x1.23-1.29 slower on the Qwen3
// layer (1, 16 and 512 tokens).
inline __m256 high_bytes_to_float(__m128i x) {
  const __m128i fp16 = _mm_and_si128(_mm_srai_epi16(x, 1), _mm_set1_epi16(static_cast<short>(0xbf80)));
  return _mm256_cvtph_ps(fp16);
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
      // channel n's K-values 2j, 2j + 1 in bytes 2n, 2n + 1
      const __m128i pairs = j % 2 == 0 ? _mm_unpacklo_epi64(a, b) : _mm_unpackhi_epi64(a, b);
      even[h] = high_bytes_to_float(_mm_slli_epi16(pairs, 8));
      odd[h] = high_bytes_to_float(pairs);
    }
  }
  __m256 scale(const uint8_t* w, int h) const {  // times the decode's 2^8
    return _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(w + kWeightBytes) + 8 * h),
                         _mm256_set1_ps(256.0f));
  }
};

}  // namespace

void gemm_fp8(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  if (group != kGroup) throw std::invalid_argument("FP8 kernels take groups of 128");
  gemm_bf16_products(Fp8Weights{}, m, K, a, panels, npanels, panel_bytes(Method::kFp8, kGroup, K), c, ldc);
}

}  // namespace kt::kernels::avx2
