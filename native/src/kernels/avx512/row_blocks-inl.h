// The outer loops of the AVX-512 kernels. Small batches (decode, at most kMaxDecodeRows rows):
// every panel with its rows in blocks of 4, then the rows left over one by one. Larger batches
// (prefill) in the BF16 and int8-input kernels: tiles of rows x panels (../tiles.h) whose
// accumulators all stay in registers, so each weight vector loaded serves every row of the tile and
// each broadcast activation every panel.
#pragma once

#include <type_traits>

#include "../tiles.h"
#include "kt/kernels.h"
#include "kt/quant_types.h"

namespace kt::kernels::avx512 {

// How far ahead of each weight stream the quantized kernels prefetch (into L1), in whole groups:
// weight_prefetch_bytes() (kt/kernels.h) rounded up, 0 for none. On Sapphire Rapids the hardware
// prefetcher alone left INT4 decode at 60% of the read bandwidth, and 4 KiB ahead beat 8 groups of
// INT8 (8.4 KiB per panel, past L1) by 5-9% (both measured with four panels per pass).
inline int64_t prefetch_distance(int64_t gbytes) {
  const int64_t bytes = weight_prefetch_bytes();
  return (bytes + gbytes - 1) / gbytes * gbytes;
}

// Calls rows(std::integral_constant<int, kRows>, i0, panel, out) for every panel with kRows = 4,
// then 1 for the rows left over; out[i] points at the 16 outputs of row i0 + i for `panel`. One
// panel per pass: with the sums in registers (with_group) its kChains independent chains keep one
// core streaming at the memory's rate (Zen 4, INT4 single row: 33 GB/s; four panels per pass 23).
template <class F>
inline void for_each_row_block(int m, const uint8_t* panels, int npanels, int64_t panel_stride, float* c,
                               int64_t ldc, F&& rows) {
  using std::integral_constant;
  const int m4 = m / 4 * 4;
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* panel = panels + p * panel_stride;
    for (int i0 = 0; i0 < m4; i0 += 4) {
      float* out[4];
      for (int i = 0; i < 4; ++i) out[i] = c + (i0 + i) * ldc + p * kPanelWidth;
      rows(integral_constant<int, 4>{}, i0, panel, out);
    }
    for (int i0 = m4; i0 < m; ++i0) {
      float* out[1] = {c + i0 * ldc + p * kPanelWidth};
      rows(integral_constant<int, 1>{}, i0, panel, out);
    }
  }
}

inline constexpr int kMaxDecodeRows = 4;

}  // namespace kt::kernels::avx512
