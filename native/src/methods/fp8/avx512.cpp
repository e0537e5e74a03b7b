// AVX-512 BF16 + VBMI FP8 GEMM: every 64 packed bytes (two rows of 16 channels x 2 K-values) are
// decoded to two rows of 32 bf16 in registers and multiplied by vdpbf16ps, as the BF16 kernel does
// with its stored rows. Up to 16 rows of A: passes of one panel, decoding in the pass (the bf16
// products skeleton, ../../kernels/avx512/bf16_products-inl.h). More: a tile's panels are decoded
// once per K-chunk into a bf16 buffer that every row tile then reads (decoded_tiles-inl.h).
// VBMI (vpermi2b) is asked for here only: the registry gives this kernel to CPUs that have it.
#pragma GCC target("avx512vbmi")
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "../../kernels/activations.h"
#include "../../kernels/avx512/bf16_products-inl.h"
#include "../../kernels/avx512/decoded_tiles-inl.h"
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

// FP8's packed rows decoded by the tables (held in registers by the skeleton's copy).
struct Fp8Weights {
  static constexpr int kGroup = fp8::kBlock;
  static constexpr int64_t group_bytes(int64_t) { return kGroupBytes; }
  DecodeTables tables;
  void rows(const uint8_t* w, int64_t k, int j, __m512bh& r0, __m512bh& r1) const {
    decode_rows(tables, w + (k / 2 + j) * 32, r0, r1);
  }
  __m512 scale(const uint8_t* w) const { return group_scale(w); }
};

// Up to 16 rows, passes of one panel (blocks of 4 rows and the rest, each decoding the panel again)
// beat decoding once into the tiles' buffer: Zen 4, one call of 16 panels x 2048 in L2, passes
// against tiles: 5 rows x1.10, 8 x1.20, 12 x1.06, 16 x1.05, 24 x0.99.
constexpr int kMaxRowBlockRows = 16;

}  // namespace

void gemm_fp8(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  if (group != kGroup) throw std::invalid_argument("FP8 kernels take groups of 128");
  const int64_t stride = panel_bytes(Method::kFp8, kGroup, K);
  static const DecodeTables tables;
  if (m <= kMaxRowBlockRows)
    return gemm_bf16_products_passes(Fp8Weights{tables}, m, K, a, panels, npanels, stride, c, ldc);
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
