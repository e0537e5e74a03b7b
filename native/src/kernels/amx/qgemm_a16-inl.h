// AMX quantized weights x bf16 activations (prefill): the down projection of INT8/INT4, and their
// gate/up for experts with many rows. The weights are dequantized once per call, a run of panels at a
// time over the whole K, into the BF16 panel layout (w = ws * q, or ws * u + wm for INT4, rounded to
// bf16), then run through the tdpbf16ps kernel: no per-group epilogue, so AMX, not the vector unit,
// sets the pace. Small batches go to the AVX-512 VNNI kernel, which reads the packed weights directly.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../avx512/codes-inl.h"
#include "../epilogue.h"
#include "kt/aligned_vector.h"
#include "tile_config.h"

namespace kt::kernels::KT_AMX_NAMESPACE {

// Dequantization in three vector steps per 16 weights: a byte permute (VBMI) moves each packed
// byte to the top of a 32-bit lane in the order the BF16 VNNI row wants; an unsigned conversion
// makes it u * 2^24 (nibbles: masked, u * 2^24 or u * 2^28: CodeLanes::top_code), exactly; one fma
// with the scale divided by that power of two and the offset gives w = ws * u + wm, rounded once.
// Two such vectors make one 64-byte BF16 VNNI row with no further shuffle.
//
// A packed VNNI row holds channel n's K-values 4r + j in byte 4n + j. BF16 VNNI row 2r + h holds
// channel n's K-values 4r + 2h and 4r + 2h + 1 in 32-bit lane n, split into two fp32 vectors of 8
// channels each (lo: channels 0-7, hi: 8-15), element 2c + i being channel c, K-value 2h + i.
struct DequantPermutes {
  __m512i idx[2][2];  // [h][hi]: source byte of each output lane, repeated in its four bytes
  __m512i pair[2];    // [hi]: which channel's scale each fp32 element takes
  DequantPermutes() {
    alignas(64) uint8_t bytes[64];
    alignas(64) uint32_t lanes[16];
    for (int h = 0; h < 2; ++h)
      for (int hi = 0; hi < 2; ++hi) {
        for (int e = 0; e < 16; ++e)
          for (int b = 0; b < 4; ++b)
            bytes[4 * e + b] = static_cast<uint8_t>(4 * (8 * hi + e / 2) + 2 * h + e % 2);
        idx[h][hi] = _mm512_load_si512(bytes);
      }
    for (int hi = 0; hi < 2; ++hi) {
      for (int e = 0; e < 16; ++e) lanes[e] = 8 * hi + e / 2;
      pair[hi] = _mm512_load_si512(lanes);
    }
  }
};

// One packed INT8/INT4 panel over K -> the BF16 panel layout (K / 2 rows of 64 bytes).
template <class D>
void dequantize_panel(const uint8_t* panel, int64_t K, int group, uint8_t* out) {
  using C = typename D::Codes;
  static const DequantPermutes perm;
  const avx512::CodeLanes<C> codes;
  const int rows = packed_rows<C>(group);
  constexpr __mmask64 kTopBytes = 0x8888888888888888ull;
  const int64_t gbytes = group_bytes(D::kMethod, group), wbytes = group_weight_bytes(D::kMethod, group);
  for (int64_t gi = 0; gi < K / group; ++gi) {
    const uint8_t* w = panel + gi * gbytes;
    // The packed weights come from DRAM: fetch two groups ahead, as the int8 kernel's staging does.
    for (int64_t off = 0; off < gbytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + 2 * gbytes + off), _MM_HINT_T0);
    // INT8 stores u = q + 128: w = ws * u - 128 * ws (exact offset, one rounding as with q).
    const auto [ws, wm] = D::template scales<Lanes>(w + wbytes, 0);
    const __m512 ws24 = _mm512_mul_ps(ws, _mm512_set1_ps(0x1p-24f));
    __m512 scale[2], offset[2];
    for (int hi = 0; hi < 2; ++hi) {
      scale[hi] = _mm512_permutexvar_ps(perm.pair[hi], ws24);
      offset[hi] = _mm512_permutexvar_ps(perm.pair[hi], wm);
    }
    // BF16 VNNI rows 2r and 2r + 1 from the top bytes `p[h][hi]` (already masked to the weight).
    auto store_rows = [&](const __m512i p[2][2], const __m512 s[2], uint8_t* dst) {
      for (int h = 0; h < 2; ++h) {
        const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepu32_ps(p[h][0]), s[0], offset[0]);
        const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepu32_ps(p[h][1]), s[1], offset[1]);
        _mm512_store_si512(dst + h * 64, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
      }
    };
    __m512 part_scale[kParts<C>][2];
    for (int p = 0; p < kParts<C>; ++p)
      for (int hi = 0; hi < 2; ++hi) part_scale[p][hi] = codes.part_scale(scale[hi], p);
    uint8_t* dst = out + gi * group / 2 * 64;
    for (int r = 0; r < rows; ++r) {
      const __m512i v = _mm512_loadu_si512(w + r * 64);
      __m512i top[2][2];
      for (int h = 0; h < 2; ++h)
        for (int hi = 0; hi < 2; ++hi)
          top[h][hi] = _mm512_maskz_permutexvar_epi8(kTopBytes, perm.idx[h][hi], v);
      for (int p = 0; p < kParts<C>; ++p) {  // part p: K-row part_row(rows, r, p), 2 BF16 VNNI rows
        __m512i code[2][2];
        for (int h = 0; h < 2; ++h)
          for (int hi = 0; hi < 2; ++hi) code[h][hi] = codes.top_code(top[h][hi], p);
        store_rows(code, part_scale[p], dst + 2 * part_row(rows, r, p) * 64);
      }
    }
  }
}

// Panels dequantized per call of the BF16 kernel: a run of panels over the whole K, within half of
// SPR's 2 MiB L2. The BF16 kernel then accumulates each 16 x 16 block of sums over all of K in its
// tiles (one tile store per block and activation chunk). Dequantizing all panels one K-chunk at a
// time instead stored and re-added every block's sums once per chunk: at 128 rows x 2048 x 1536 the
// INT8 kernel ran at 0.30 TOPS on one Emerald Rapids core, the BF16 kernel at 1.08.
inline constexpr int64_t kDequantRunBytes = 1 << 20;

template <class D>
void gemm_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  if (m <= 4) return avx512::gemm_a16<D>(m, K, group, a, panels, npanels, c, ldc);
  const int64_t pbytes = panel_bytes(D::kMethod, group, K);
  const int64_t bf16_panel_bytes = panel_bytes(Method::kBf16, kKAlign, K);
  const int run =
      static_cast<int>(std::clamp<int64_t>(kDequantRunBytes / bf16_panel_bytes / 2 * 2, 2, npanels));
  struct Scratch {
    AlignedVector<uint8_t> dequantized;
  };
  auto& dequantized = thread_scratch<Scratch>()->dequantized;
  if (dequantized.size() < static_cast<size_t>(run * bf16_panel_bytes))
    dequantized.resize(run * bf16_panel_bytes);
  for (int p0 = 0; p0 < npanels; p0 += run) {
    const int n = std::min(run, npanels - p0);
    for (int p = 0; p < n; ++p)
      dequantize_panel<D>(panels + (p0 + p) * pbytes, K, group, dequantized.data() + p * bf16_panel_bytes);
    gemm_bf16(m, K, kKAlign, a, dequantized.data(), n, c + p0 * kPanelWidth, ldc);
  }
}

}  // namespace kt::kernels::KT_AMX_NAMESPACE
