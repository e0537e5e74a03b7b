// AVX2 + FMA fallback for BF16: the bf16 products skeleton (../../kernels/avx2/bf16_products-inl.h)
// with the stored rows widened to fp32 by a shift and a mask.
#include <immintrin.h>

#include <cstdint>

#include "../../kernels/avx2/bf16_products-inl.h"
#include "kt/quant_types.h"

namespace kt::kernels::avx2 {

namespace {

struct Bf16Weights {
  static constexpr int kGroup = 0;
  static constexpr int64_t group_bytes(int64_t K) { return K * kPanelWidth * 2; }
  // A pair (w0, w1) is the low and high half of one 32-bit lane.
  void decode(const uint8_t* w, int64_t k, int j, __m256 even[2], __m256 odd[2]) const {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 32 + j * 64 + 32 * h));
      even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
  }
};

}  // namespace

void gemm_bf16(int m, int64_t K, int, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  gemm_bf16_products(Bf16Weights{}, m, K, a, panels, npanels, panel_bytes(Method::kBf16, kKAlign, K), c, ldc);
}

}  // namespace kt::kernels::avx2
