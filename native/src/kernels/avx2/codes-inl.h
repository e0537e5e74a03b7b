// A code layout's lane operations in AVX2 registers (../codes.h): the parts of half a packed row (32
// bytes: 8 channels x 4 codes a byte part) as the lanes each kind of kernel multiplies. Made once
// before a kernel's loops; every operation is inlined.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../codes.h"

namespace kt::kernels::avx2 {

template <class C>
class CodeLanes {
  static constexpr int kMask = (1 << C::kBits) - 1;

 public:
  __attribute__((always_inline)) CodeLanes()
      : byte_mask_(_mm256_set1_epi8(static_cast<char>(kMask))),
        word_mask_(_mm256_set1_epi16(kMask)),
        lane_mask_(_mm256_set1_epi32(kMask)) {
    if constexpr (C::kHasCodebook)
      word_table_ =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(C::kCodebook)));
    if constexpr (C::kBits < 8) {
      alignas(32) float floats[16];
      for (int i = 0; i < 16; ++i) floats[i] = static_cast<float>(code_value<C>(static_cast<uint8_t>(i)));
      table_lo_ = _mm256_load_ps(floats), table_hi_ = _mm256_load_ps(floats + 8);
    }
  }

  // Part p of v as bytes of value(u), for vpmaddubsw (int8-input kernels only).
  __attribute__((always_inline)) __m256i values(__m256i v, int p) const {
    static_assert(!C::kHasCodebook && (C::kBias == 0 || C::kBias == 128));
    if constexpr (C::kBias == 128) {  // q = u - 128: flip the top bit
      return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
    } else if constexpr (C::kBits == 8) {
      return v;
    } else {
      if (p == 0) return _mm256_and_si256(v, byte_mask_);
      return _mm256_and_si256(_mm256_srli_epi16(v, C::kBits * p), byte_mask_);
    }
  }
  // vpmaddubsw's unsigned operand for values q: |q| where they are signed (the activations then take
  // q's sign, pair_sums), else q.
  __attribute__((always_inline)) static __m256i magnitude(__m256i q) {
    if constexpr (kSignedValues<C>)
      return _mm256_abs_epi8(q);
    else
      return q;
  }
  // s16 sums of adjacent (value x activation) pairs of one part, from its values q and their
  // magnitude m, with the activations x. They must not saturate, added over the parts in s16 too:
  // INT8 (one part) |q| <= 128, |x| <= 127: pairs <= 2 * 128 * 127 < 32767; nibbles: 2 parts of
  // pairs <= 2 * 15 * 127.
  __attribute__((always_inline)) static __m256i pair_sums(__m256i m, __m256i q, __m256i x) {
    if constexpr (kSignedValues<C>)
      return _mm256_maddubs_epi16(m, _mm256_sign_epi8(x, q));
    else
      return _mm256_maddubs_epi16(m, x);
  }

  // acc + wm * x where the kernel multiplied value(u) (../codes.h, plus_value_offset).
  __attribute__((always_inline)) static __m256 plus_value_offset(__m256 acc, __m256 wm, __m256 x) {
    if constexpr (C::kBias == 0)
      return _mm256_fmadd_ps(wm, x, acc);
    else
      return acc;
  }

  // 16-bit lanes j = 2p + b (b: bytes 0, 2 or 1, 3 of each 32-bit lane) of part p as int16 codes,
  // or their codebook values: a byte shuffle puts each lane's value in its low byte (the high byte
  // looks up code 0, i.e. 0), and two shifts sign-extend it.
  __attribute__((always_inline)) __m256i words(__m256i v, int j) const {
    const int shift = 8 * (j % 2) + C::kBits * (j / 2);
    const __m256i shifted = shift == 0 ? v : _mm256_srli_epi16(v, shift);
    const __m256i u = shift + C::kBits == 16 ? shifted : _mm256_and_si256(shifted, word_mask_);
    if constexpr (C::kHasCodebook)
      return _mm256_srai_epi16(_mm256_slli_epi16(_mm256_shuffle_epi8(word_table_, u), 8), 8);
    else
      return u;
  }

  // The code at bit `shift` of each 32-bit lane of v.
  __attribute__((always_inline)) __m256i lane_code(__m256i v, int shift) const {
    return _mm256_and_si256(_mm256_srli_epi32(v, shift), lane_mask_);
  }
  // value(code) of each 32-bit lane as fp32; 16 codes are two 8-entry lookups.
  __attribute__((always_inline)) __m256 lane_value(__m256i code) const {
    if constexpr (C::kBits == 8)
      return _mm256_cvtepi32_ps(_mm256_sub_epi32(code, _mm256_set1_epi32(C::kBias)));
    else
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(table_lo_, code),
                              _mm256_permutevar8x32_ps(table_hi_, code),
                              _mm256_castsi256_ps(_mm256_cmpgt_epi32(code, _mm256_set1_epi32(7))));
  }

 private:
  __m256i byte_mask_, word_mask_, lane_mask_;
  __m256i word_table_ = _mm256_setzero_si256();
  __m256 table_lo_ = _mm256_setzero_ps(), table_hi_ = _mm256_setzero_ps();
};

}  // namespace kt::kernels::avx2
