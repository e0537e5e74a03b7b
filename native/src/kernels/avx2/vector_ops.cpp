// Element-wise steps around the GEMMs, 8 lanes at a time; the last partial vector goes through a
// padded copy so every element takes the same arithmetic.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kt/float_types.h"
#include "kt/kernels.h"

namespace kt::kernels::avx2 {

namespace {

// exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, and e^r by its Taylor series to r^6
// (relative error ~1e-7). Inputs are clamped to [-87, 89]: 2^n stays normal below and is
// infinite from 88.38 (n = 128), so silu of a very negative input is -0, not a tiny remainder.
__m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln 2 split in two for exactness
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Round to nearest even as float_to_bf16 does, NaN kept quiet.
__m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, quiet, nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // lanes 0 and 2
  return _mm256_castsi256_si128(packed);
}

__m128i silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return to_bf16(_mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u));
}

}  // namespace

void silu_mul(const float* gate, const float* up, int64_t n, uint16_t* h) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i),
                     silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i == n) return;
  alignas(32) float g[8] = {}, u[8] = {};
  alignas(16) uint16_t out[8];
  std::copy(gate + i, gate + n, g), std::copy(up + i, up + n, u);
  _mm_store_si128(reinterpret_cast<__m128i*>(out), silu_mul8(_mm256_load_ps(g), _mm256_load_ps(u)));
  std::copy(out, out + (n - i), h + i);
}

void add_weighted(float* y, const float* c, float weight, int64_t n) {
  const __m256 w = _mm256_set1_ps(weight);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(c + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = std::fma(weight, c[i], y[i]);
}

void sum_to_bf16(const float* const* parts, int nparts, int64_t n, bool accumulate, uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_setzero_ps();
    if (accumulate) {
      const __m256i prior = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(out + i)));
      v = _mm256_castsi256_ps(_mm256_slli_epi32(prior, 16));
    }
    for (int p = 0; p < nparts; ++p) v = _mm256_add_ps(v, _mm256_loadu_ps(parts[p] + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), to_bf16(v));
  }
  for (; i < n; ++i) {  // the scalar twin's arithmetic, element by element
    float v = accumulate ? bf16_to_float(out[i]) : 0.0f;
    for (int p = 0; p < nparts; ++p) v += parts[p][i];
    out[i] = float_to_bf16(v);
  }
}

}  // namespace kt::kernels::avx2
