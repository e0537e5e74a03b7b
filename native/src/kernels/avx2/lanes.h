// 8 fp32 lanes (half a panel's channels): the AVX2 kernels' view of a decoder's scales
// (../epilogue.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kt::kernels::avx2 {

// 8 e4m3 bytes as fp32, exactly (NaN codes are refused at load): normal codes move their exponent
// and mantissa bits into place, subnormal ones (exponent 0) are mantissa * 2^-9.
__attribute__((always_inline)) inline __m256 e4m3_to_ps(__m128i bytes) {
  const __m256i b = _mm256_cvtepu8_epi32(bytes);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  const __m256 normal =
      _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
  const __m256 is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  const __m256 v = _mm256_blendv_ps(normal, subnormal, is_subnormal);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}

struct Lanes {
  using F = __m256;
  static constexpr int kCount = 8;
  __attribute__((always_inline)) static F fp16(const uint8_t* p) { return _mm256_cvtph_ps(load16(p)); }
  __attribute__((always_inline)) static F bf16(const uint8_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(p)), 16));
  }
  __attribute__((always_inline)) static F e8m0(const uint8_t* p) {  // 2^(e - 127): e in the exponent field
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(load8(p)), 23));
  }
  __attribute__((always_inline)) static F e4m3(const uint8_t* p) { return e4m3_to_ps(load8(p)); }
  __attribute__((always_inline)) static F set1(float x) { return _mm256_set1_ps(x); }
  __attribute__((always_inline)) static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  __attribute__((always_inline)) static F zero() { return _mm256_setzero_ps(); }

 private:
  __attribute__((always_inline)) static __m128i load16(const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  __attribute__((always_inline)) static __m128i load8(const uint8_t* p) {
    return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  }
};

}  // namespace kt::kernels::avx2
