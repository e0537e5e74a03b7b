// 16 fp32 lanes (a panel's channels): the AVX-512 kernels' view of a decoder's scales
// (../epilogue.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kt::kernels::avx512 {

// 16 e4m3 bytes as fp32, exactly (NaN codes are refused at load): normal codes move their exponent
// and mantissa bits into place, subnormal ones (exponent 0) are mantissa * 2^-9.
__attribute__((always_inline)) inline __m512 e4m3_to_ps(__m128i bytes) {
  const __m512i b = _mm512_cvtepu8_epi32(bytes);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  const __m512 normal =
      _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
  const __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 v = _mm512_mask_blend_ps(is_subnormal, normal, subnormal);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// Always inlined: the AMX files include it too, and an out-of-line copy built with AMX's flags could
// serve the AVX-512 path.
struct Lanes {
  using F = __m512;
  static constexpr int kCount = 16;
  __attribute__((always_inline)) static F fp16(const uint8_t* p) { return _mm512_cvtph_ps(load32(p)); }
  __attribute__((always_inline)) static F bf16(const uint8_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load32(p)), 16));
  }
  __attribute__((always_inline)) static F e8m0(const uint8_t* p) {  // 2^(e - 127): e in the exponent field
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(load16(p)), 23));
  }
  __attribute__((always_inline)) static F e4m3(const uint8_t* p) { return e4m3_to_ps(load16(p)); }
  __attribute__((always_inline)) static F set1(float x) { return _mm512_set1_ps(x); }
  __attribute__((always_inline)) static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  __attribute__((always_inline)) static F zero() { return _mm512_setzero_ps(); }

 private:
  __attribute__((always_inline)) static __m256i load32(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  __attribute__((always_inline)) static __m128i load16(const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
};

}  // namespace kt::kernels::avx512
