// Loops shared by the SIMD kernel families: a run-time count or group size turned into a
// compile-time one, and tiles of rows x panels. Templates only, always instantiated with a kernel
// family's own lambdas, so no instantiation is shared between files built with different target
// flags (an inline function compiled for AVX-512 must never serve the AVX2 path).
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace kt::kernels {

// Calls f(std::integral_constant<int, n>) for a run-time 1 <= n <= kMax.
template <int kMax, class F>
inline void with_count(int n, F&& f) {
  [&]<int... kN>(std::integer_sequence<int, kN...>) {
    ((n == kN + 1 ? (f(std::integral_constant<int, kN + 1>{}), 0) : 0), ...);
  }(std::make_integer_sequence<int, kMax>{});
}

// Calls f(std::integral_constant<int, group>) for the quantization groups of 16 (NVFP4), 32, 64 and
// 128 (the only ones a layer accepts): a group known at compile time lets the compiler unroll the group's
// loops and keep its accumulators in registers, where a run-time group left the INT4 single-row
// pass with its sums on the stack (one core: 24 GB/s against 32).
template <class F>
inline void with_group(int group, F&& f) {
  using std::integral_constant;
  switch (group) {
    case 16:  // NVFP4; the GGUF K-quants of 16-value sub-blocks (Q2_K, Q3_K, Q6_K)
      return f(integral_constant<int, 16>{});
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

}  // namespace kt::kernels
