// A code layout's lane operations in AVX-512 registers (../codes.h), for the AVX-512 and AMX kernels:
// the parts of a packed row (64 bytes: 16 channels x 4 codes a byte part) as the lanes each kind of
// kernel multiplies. Made once before a kernel's loops (the constants stay in registers); every
// operation is inlined, so the kernels compile as if they had unpacked the codes themselves.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../codes.h"

namespace kt::kernels::avx512 {

template <class C>
class CodeLanes {
  static constexpr int kMask = (1 << C::kBits) - 1;

 public:
  __attribute__((always_inline)) CodeLanes()
      : byte_mask_(_mm512_set1_epi8(static_cast<char>(kMask))),
        word_mask_(_mm512_set1_epi16(kMask)),
        lane_mask_(_mm512_set1_epi32(kMask)) {
    if constexpr (C::kHasCodebook) {
      alignas(64) int16_t words[32] = {};  // codes index the first 16
      alignas(64) float floats[16];
      for (int i = 0; i < 16; ++i) words[i] = C::kCodebook[i], floats[i] = C::kCodebook[i];
      word_table_ = _mm512_load_si512(words);
      float_table_ = _mm512_load_ps(floats);
    } else if constexpr (C::kBits < 8) {
      alignas(64) float floats[16];
      for (int i = 0; i < 16; ++i) floats[i] = static_cast<float>(code_value<C>(static_cast<uint8_t>(i)));
      float_table_ = _mm512_load_ps(floats);
    }
    if constexpr (requires { C::kDecoded; }) decoded_table_ = _mm512_load_ps(C::kDecoded);
  }

  // Part p of packed row v as unsigned bytes u (vpdpbusd's weights).
  __attribute__((always_inline)) __m512i codes(__m512i v, int p) const {
    if constexpr (C::kBits == 8) {
      return v;
    } else {
      if (p == 0) return _mm512_and_si512(v, byte_mask_);
      return _mm512_and_si512(_mm512_srli_epi16(v, C::kBits * p), byte_mask_);
    }
  }

  // Part p as bytes of value(u): signed where kSignedValues (an integer layout only).
  __attribute__((always_inline)) __m512i values(__m512i v, int p) const {
    static_assert(!C::kHasCodebook && (C::kBias == 0 || C::kBias == 128));
    if constexpr (C::kBias == 128)  // q = u - 128: flip the top bit
      return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
    else
      return codes(v, p);
  }

  // 16-bit lanes j = 2p + b (b: bytes 0, 2 or 1, 3 of each 32-bit lane) of part p as int16 codes,
  // or their codebook values (vpdpwssd's weights).
  __attribute__((always_inline)) __m512i words(__m512i v, int j) const {
    const int shift = 8 * (j % 2) + C::kBits * (j / 2);
    const __m512i shifted = shift == 0 ? v : _mm512_srli_epi16(v, shift);
    const __m512i u = shift + C::kBits == 16 ? shifted : _mm512_and_si512(shifted, word_mask_);
    if constexpr (C::kHasCodebook) return _mm512_permutexvar_epi16(u, word_table_);
    return u;
  }

  // The code of part p in the top byte of each 32-bit lane of `top` (a byte moved there, the rest
  // zero), as u * 2^(24 + kBits p): its scale takes the factor 2^-(kBits p) (part_scale).
  __attribute__((always_inline)) __m512i top_code(__m512i top, int p) const {
    if constexpr (C::kBits == 8)
      return top;
    else
      return _mm512_and_si512(
          top, _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(kMask) << (24 + C::kBits * p))));
  }
  __attribute__((always_inline)) static __m512 part_scale(__m512 scale, int p) {
    if (p == 0) return scale;
    return _mm512_mul_ps(scale, _mm512_set1_ps(1.0f / static_cast<float>(1 << (C::kBits * p))));
  }

  // acc + wm * x where the kernel multiplied value(u) (../codes.h, plus_value_offset).
  __attribute__((always_inline)) static __m512 plus_value_offset(__m512 acc, __m512 wm, __m512 x) {
    if constexpr (C::kBias == 0)
      return _mm512_fmadd_ps(wm, x, acc);
    else
      return acc;
  }

  // The code at bit `shift` of each 32-bit lane of v.
  __attribute__((always_inline)) __m512i lane_code(__m512i v, int shift) const {
    return _mm512_and_si512(_mm512_srli_epi32(v, shift), lane_mask_);
  }
  // value(code) of each 32-bit lane as fp32.
  __attribute__((always_inline)) __m512 lane_value(__m512i code) const {
    if constexpr (C::kBits == 8)
      return _mm512_cvtepi32_ps(_mm512_sub_epi32(code, _mm512_set1_epi32(C::kBias)));
    else
      return _mm512_permutexvar_ps(code, float_table_);
  }
  // The value of each 32-bit lane's code in the decoded prefill (C::kDecoded), as fp32.
  __attribute__((always_inline)) __m512 lane_decoded(__m512i code) const {
    return _mm512_permutexvar_ps(code, decoded_table_);
  }

 private:
  __m512i byte_mask_, word_mask_, lane_mask_;
  __m512i word_table_ = _mm512_setzero_si512();
  __m512 float_table_ = _mm512_setzero_ps(), decoded_table_ = _mm512_setzero_ps();
};

}  // namespace kt::kernels::avx512
