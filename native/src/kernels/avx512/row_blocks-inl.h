// The outer loops of the AVX-512 kernels. Small batches (decode: a few rows per expert, as many as
// each kernel says): every panel with its rows in blocks of 4, then the 1-3 rows left over in one
// pass. Larger batches (prefill) in the BF16 and int8-input kernels: tiles of rows x panels
// (../tiles.h) whose accumulators all stay in registers, so each weight vector loaded serves every
// row of the tile and each broadcast activation every panel.
#pragma once

#include <cstdint>

#include "../tiles.h"
#include "kt/kernels.h"
#include "kt/quant_types.h"

namespace kt::kernels::avx512 {

// Calls rows(std::integral_constant<int, kRows>, i0, panel, out) for every panel with kRows = 4,
// then once with the 1-3 rows left over; out[i] points at the 16 outputs of row i0 + i for `panel`.
// One panel per pass: with the sums in registers (with_group) its kChains independent chains keep
// one core streaming at the memory's rate (Zen 4, INT4 single row: 33 GB/s; four panels per pass
// 23). The rows left over share a pass, so the panel is loaded and unpacked once for them (they
// took one pass each: Qwen3 at 16 tokens INT4 x1.06-1.24, INT8 x1.05-1.17).
template <class F>
inline void for_each_row_block(int m, const uint8_t* panels, int npanels, int64_t panel_stride, float* c,
                               int64_t ldc, F&& rows) {
  for_each_tile<4, 1>(m, npanels, [&](auto block, auto, int i0, int p) {
    float* out[decltype(block)::value];
    for (int i = 0; i < decltype(block)::value; ++i) out[i] = c + (i0 + i) * ldc + p * kPanelWidth;
    rows(block, i0, panels + p * panel_stride, out);
  });
}

}  // namespace kt::kernels::avx512
