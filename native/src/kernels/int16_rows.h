// The A16 kernels' activations (quantized weights x bf16 inputs): rows of A requantized to int16
// per (row, group), scale = max |a| / 32767, and the K-values of each 4 stored in the order
// (0, 2, 1, 3) so that a 32-bit broadcast pairs with the weight bytes a 16-bit mask or shift selects
// (avx512/qgemm_a16-inl.h). One layout for every family that runs the scheme; each fills it with
// its own vectors. A template on the family, like tiles.h: no instantiation is shared between files
// built with different target flags.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kt::kernels {

template <class Family>
struct Int16Rows {
  std::vector<int16_t> q;                // [m][K]
  std::vector<float> scale, scaled_sum;  // [m][K / group]
  void reserve(int m, int64_t K, int64_t groups) {
    if (q.size() < static_cast<size_t>(m * K)) q.resize(m * K);
    if (scale.size() < static_cast<size_t>(m * groups))
      scale.resize(m * groups), scaled_sum.resize(m * groups);
  }
};

}  // namespace kt::kernels
