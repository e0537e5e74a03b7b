// Element-wise steps around the GEMMs, 16 lanes at a time (AVX-512F only: a CPU of this family may
// lack AVX-512 BF16, so bf16 rounding is done on the integers).
#include <immintrin.h>

#include <cstdint>

#include "kt/kernels.h"

namespace kt::kernels::avx512 {

namespace {

// exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, and e^r by its Taylor series to r^6
// (relative error ~1e-7). Inputs are clamped to [-87, 89]: 2^n stays normal below and is
// infinite above 88.72 (so silu of a very negative input is -0, not a tiny remainder).
__m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(89.0f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 split in two for exactness
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Round to nearest even as float_to_bf16 does, NaN kept quiet.
__m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

}  // namespace

void silu_mul(const float* gate, const float* up, int64_t n, uint16_t* h) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 u = _mm512_maskz_loadu_ps(m, up + i);
    const __m512 s =
        _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm256_mask_storeu_epi16(h + i, m, to_bf16(_mm512_mul_ps(s, u)));
  }
}

void add_weighted(float* y, const float* c, float weight, int64_t n) {
  const __m512 w = _mm512_set1_ps(weight);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(
        y + i, m, _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, c + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

void sum_to_bf16(const float* const* parts, int nparts, int64_t n, bool accumulate, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 v = _mm512_setzero_ps();
    if (accumulate) {
      const __m512i prior = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, out + i));
      v = _mm512_castsi512_ps(_mm512_slli_epi32(prior, 16));
    }
    for (int p = 0; p < nparts; ++p) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, parts[p] + i));
    _mm256_mask_storeu_epi16(out + i, m, to_bf16(v));
  }
}

}  // namespace kt::kernels::avx512
