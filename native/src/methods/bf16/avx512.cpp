// AVX-512 BF16: vdpbf16ps on the VNNI-paired panel rows. Decode: up to 4 rows of A per pass (the
// bf16 products skeleton, bf16_products-inl.h); prefill: tiles of rows x panels.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../../kernels/activations.h"
#include "../../kernels/avx512/bf16_products-inl.h"
#include "kt/quant_types.h"

namespace kt::kernels::avx512 {

namespace {

// BF16's packed rows are bf16 already: loaded as they are.
struct Bf16Weights {
  static constexpr int kGroup = 0;
  static constexpr int64_t group_bytes(int64_t K) { return K * kPanelWidth * 2; }
  void rows(const uint8_t* w, int64_t k, int j, __m512bh& r0, __m512bh& r1) const {
    const uint8_t* row = w + k * 32 + j * 64;
    r0 = (__m512bh)_mm512_loadu_si512(row);
    r1 = (__m512bh)_mm512_loadu_si512(row + 64);
  }
};

// A prefill tile of kRows x kPanels fp32 sums in registers over all of K; never inlined, like
// gemm_quant_tile, so that its code does not depend on the dispatcher around it.
template <int kRows, int kPanels>
__attribute__((noinline)) void gemm_bf16_tile(int64_t K, const Bf16Rows& a, int i0, const uint8_t* panel0,
                                              int64_t panel_stride, float* c, int64_t ldc) {
  __m512 acc[kRows][kPanels];
  for (int i = 0; i < kRows; ++i)
    for (int p = 0; p < kPanels; ++p) acc[i][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {  // one 64-byte chunk of each row: 16 K-pairs
    const int32_t* x[kRows];
    for (int i = 0; i < kRows; ++i) x[i] = reinterpret_cast<const int32_t*>(bf16_at(a, i0 + i, k));
    const uint8_t* wk = panel0 + k * 64 / 2;
    for (int j = 0; j < 16; ++j) {
      __m512bh wv[kPanels];
      for (int p = 0; p < kPanels; ++p) wv[p] = (__m512bh)_mm512_loadu_si512(wk + p * panel_stride + j * 64);
      for (int i = 0; i < kRows; ++i) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[i][j]);
        for (int p = 0; p < kPanels; ++p) acc[i][p] = _mm512_dpbf16_ps(acc[i][p], xv, wv[p]);
      }
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int p = 0; p < kPanels; ++p) _mm512_storeu_ps(c + (i0 + i) * ldc + p * kPanelWidth, acc[i][p]);
}

// Up to 4 rows, passes of one panel; more take the 6 x 4 tiles (Zen 4, Qwen3 experts of m rows,
// passes against tiles: m = 5 x1.01-1.04, 6-8 x0.84-0.99). Local to this file: the quantized
// kernels' threshold of the same name is 8.
constexpr int kMaxRowBlockRows = 4;

}  // namespace

void gemm_bf16(int m, int64_t K, int, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  const int64_t stride = panel_bytes(Method::kBf16, kKAlign, K);
  if (m > kMaxRowBlockRows) {
    // 6 x 4: 24 fp32 sums, 4 weight vectors and a broadcast fill the 32 registers (x1.04-1.06 over
    // the decode blocks at m = 32-256 on Zen 4, one vdpbf16ps per cycle).
    for_each_tile<6, 4>(m, npanels, [&](auto rows, auto tile_panels, int i0, int p0) {
      gemm_bf16_tile<decltype(rows)::value, decltype(tile_panels)::value>(K, a, i0, panels + p0 * stride,
                                                                          stride, c + p0 * kPanelWidth, ldc);
    });
    return;
  }
  gemm_bf16_products_passes(Bf16Weights{}, m, K, a, panels, npanels, stride, c, ldc);
}

}  // namespace kt::kernels::avx512
