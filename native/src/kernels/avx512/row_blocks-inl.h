// The outer loop of the AVX-512 kernels: every panel, its rows in blocks of 4, then one by one (the
// row kernels keep one accumulator set per row in registers).
#pragma once

#include <type_traits>

#include "kt/quant_types.h"

namespace kt::kernels::avx512 {

// Calls rows(std::integral_constant<int, kRows>, i0, panel, out) with kRows 4 or 1; out[i] points
// at the 16 outputs of row i0 + i for the panel.
template <class F>
inline void for_each_row_block(int m, const uint8_t* panels, int npanels, int64_t panel_stride, float* c,
                               int64_t ldc, F&& rows) {
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* panel = panels + p * panel_stride;
    int i0 = 0;
    for (; i0 + 4 <= m; i0 += 4) {
      float* out[4];
      for (int i = 0; i < 4; ++i) out[i] = c + (i0 + i) * ldc + p * kPanelWidth;
      rows(std::integral_constant<int, 4>{}, i0, panel, out);
    }
    for (; i0 < m; ++i0) {
      float* out[1] = {c + i0 * ldc + p * kPanelWidth};
      rows(std::integral_constant<int, 1>{}, i0, panel, out);
    }
  }
}

}  // namespace kt::kernels::avx512
