// AVX-512 BF16 + VBMI FP8 GEMM: every 64 packed bytes (two rows of 16 channels x 2 K-values) are
// decoded to two rows of 32 bf16 in registers and multiplied by vdpbf16ps, as the BF16 kernel does
// with its stored rows. Up to 16 rows of A: passes of one panel, decoding in the pass. More: a
// tile's panels are decoded once per K-chunk into a bf16 buffer that every row tile then reads
// (../../kernels/avx512/decoded_tiles-inl.h).
// VBMI (vpermi2b) is asked for here only: the registry gives this kernel to CPUs that have it.
#pragma GCC target("avx512vbmi")
#include <immintrin.h>

#include <algorithm>
#include <stdexcept>

#include "../../kernels/activations.h"
#include "../../kernels/avx512/decoded_tiles-inl.h"
#include "../../kernels/avx512/row_blocks-inl.h"
#include "../../kernels/tiles.h"
#include "fp8.h"

namespace kt::kernels::avx512 {

namespace {

constexpr int kGroup = fp8::kBlock;
constexpr int64_t kGroupBytes = group_bytes(Method::kFp8, kGroup);
constexpr int64_t kWeightBytes = group_weight_bytes(Method::kFp8, kGroup);
// The bytes of the bf16 value of each e4m3 magnitude code, high and low, as vpermi2b tables.
struct DecodeTables {
  __m512i hi0, hi1, lo0, lo1;
  DecodeTables() {
    alignas(64) uint8_t hi[128], lo[128];
    for (int m = 0; m < 128; ++m)
      hi[m] = static_cast<uint8_t>(fp8::e4m3_magnitude_as_bf16(m) >> 8),
      lo[m] = static_cast<uint8_t>(fp8::e4m3_magnitude_as_bf16(m) & 0xff);
    hi0 = _mm512_load_si512(hi), hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo), lo1 = _mm512_load_si512(lo + 64);
  }
};

// 64 packed bytes -> their even and odd rows as bf16, exactly: a 128-entry byte lookup (the index's
// top bit, the sign, is ignored) gives each value's low and high bf16 byte, the sign joins the high
// byte, and unpacking within 16-byte lanes puts the two rows back in order (fp8.h). Zen 4, one core,
// weights in L2: 35 GB/s against 14 by fp16 and fp32 conversions, 22 by 16-bit lookups.
inline void decode_rows(const DecodeTables& t, const uint8_t* p, __m512bh& even, __m512bh& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  const __m512i hi =
      _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, x, t.hi1), x,
                                _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);  // a | (b & c)
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, x, t.lo1);
  even = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
  odd = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

inline __m512 group_scale(const uint8_t* group) {
  return _mm512_loadu_ps(reinterpret_cast<const float*>(group + kWeightBytes));
}

// kRows rows of one panel per pass (decode), the group's sums in kChains chains per row.
template <int kRows>
void gemm_fp8_rows(int64_t K, const Bf16Rows& a, int i0, const uint8_t* panel, float* const* out) {
  constexpr int kChains = kRows == 1 ? 4 : 2;  // even: the rows come in pairs
  static const DecodeTables tables;
  const DecodeTables t = tables;
  const int64_t ahead = weight_prefetch_bytes();
  __m512 total[kRows];
  for (int i = 0; i < kRows; ++i) total[i] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < K / kGroup; ++gi) {
    const uint8_t* w = panel + gi * kGroupBytes;
    for (int64_t off = 0; ahead > 0 && off < kGroupBytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w) + ahead + off, _MM_HINT_T0);
    __m512 acc[kRows][kChains];
    for (int i = 0; i < kRows; ++i)
      for (int u = 0; u < kChains; ++u) acc[i][u] = _mm512_setzero_ps();
    for (int k = 0; k < kGroup; k += 32) {  // one 64-byte chunk of each row: 16 K-pairs
      const int32_t* x[kRows];
      for (int i = 0; i < kRows; ++i)
        x[i] = reinterpret_cast<const int32_t*>(bf16_at(a, i0 + i, gi * kGroup + k));
      for (int j = 0; j < 16; j += kChains)
        for (int u = 0; u < kChains; u += 2) {
          __m512bh wv[2];
          decode_rows(t, w + (k / 2 + j + u) * 32, wv[0], wv[1]);
          for (int v = 0; v < 2; ++v)
            for (int i = 0; i < kRows; ++i)
              acc[i][u + v] =
                  _mm512_dpbf16_ps(acc[i][u + v], (__m512bh)_mm512_set1_epi32(x[i][j + u + v]), wv[v]);
        }
    }
    const __m512 scale = group_scale(w);
    for (int i = 0; i < kRows; ++i) {
      __m512 sum = acc[i][0];
      for (int u = 1; u < kChains; ++u) sum = _mm512_add_ps(sum, acc[i][u]);
      total[i] = _mm512_fmadd_ps(sum, scale, total[i]);
    }
  }
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(out[i], total[i]);
}

// Up to 16 rows, passes of one panel (blocks of 4 rows and the rest, each decoding the panel again)
// beat decoding once into the tiles' buffer: Zen 4, one call of 16 panels x 2048 in L2, passes
// against tiles: 5 rows x1.10, 8 x1.20, 12 x1.06, 16 x1.05, 24 x0.99.
constexpr int kMaxRowBlockRows = 16;

}  // namespace

void gemm_fp8(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  if (group != kGroup) throw std::invalid_argument("FP8 kernels take groups of 128");
  const int64_t stride = panel_bytes(Method::kFp8, kGroup, K);
  if (m <= kMaxRowBlockRows) {
    for_each_row_block(m, panels, npanels, stride, c, ldc,
                       [&](auto rows, int i0, const uint8_t* panel, float* const* out) {
                         gemm_fp8_rows<decltype(rows)::value>(K, a, i0, panel, out);
                       });
    return;
  }
  static const DecodeTables tables;
  const DecodeTables t = tables;
  const auto decode = [&](const uint8_t* panel, int64_t gi, uint16_t* d) {
    const uint8_t* w = panel + gi * kGroupBytes;
    for (int r = 0; r < kGroup / 2; r += 2) {
      __m512bh even, odd;
      decode_rows(t, w + r * 32, even, odd);
      _mm512_store_si512(d + r * 32, (__m512i)even);
      _mm512_store_si512(d + (r + 1) * 32, (__m512i)odd);
    }
  };
  const auto scale = [](const uint8_t* panel, int64_t gi) { return group_scale(panel + gi * kGroupBytes); };
  gemm_decoded<kGroup>(m, K, a, panels, npanels, stride, c, ldc, decode, scale);
}

}  // namespace kt::kernels::avx512
