// The outer loops of the AVX-512 kernels. Small batches (decode, at most kMaxDecodeRows rows):
// every panel with its rows in blocks of 4, then the rows left over one by one. Larger batches
// (prefill) in the BF16 and int8-input kernels: tiles of rows x panels whose accumulators all stay
// in registers, so each weight vector loaded serves every row of the tile and each broadcast
// activation every panel.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

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

// Calls f(std::integral_constant<int, n>) for a run-time 1 <= n <= kMax.
template <int kMax, class F>
inline void with_count(int n, F&& f) {
  [&]<int... kN>(std::integer_sequence<int, kN...>) {
    ((n == kN + 1 ? (f(std::integral_constant<int, kN + 1>{}), 0) : 0), ...);
  }(std::make_integer_sequence<int, kMax>{});
}

// Calls f(std::integral_constant<int, group>) for the quantization groups of 32, 64 and 128 (the
// only ones a layer accepts): a group known at compile time lets the compiler unroll the group's
// loops and keep its accumulators in registers, where a run-time group left the INT4 single-row
// pass with its sums on the stack (one core: 24 GB/s against 32).
template <class F>
inline void with_group(int group, F&& f) {
  using std::integral_constant;
  switch (group) {
    case 32:
      return f(integral_constant<int, 32>{});
    case 64:
      return f(integral_constant<int, 64>{});
    case 128:
      return f(integral_constant<int, 128>{});
    default:
      throw std::invalid_argument("no kernel for quantization groups of " + std::to_string(group));
  }
}

// Calls tile(std::integral_constant<int, rows>, std::integral_constant<int, panels>, i0, p0) for
// rows [i0, i0 + rows) x panels [p0, p0 + panels), at most kRows x kPanels each, covering
// m x npanels: panel tiles outer, so their weights are re-read from cache by every row tile.
template <int kRows, int kPanels, class F>
inline void for_each_tile(int m, int npanels, F&& tile) {
  for (int p0 = 0; p0 < npanels; p0 += kPanels)
    with_count<kPanels>(std::min(kPanels, npanels - p0), [&](auto panels) {
      for (int i0 = 0; i0 < m; i0 += kRows)
        with_count<kRows>(std::min(kRows, m - i0), [&](auto rows) { tile(rows, panels, i0, p0); });
    });
}

}  // namespace kt::kernels::avx512
