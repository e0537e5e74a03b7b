// Portable twin of the A16 GEMMs: quantized weights, bf16 activations (see ../epilogue.h).
#pragma once

#include <cstdint>

#include "../activations.h"
#include "../epilogue.h"
#include "kt/kernels.h"
#include "lanes.h"

namespace kt::kernels::scalar {

// Quantized weights, bf16 activations: per group, ws * sum(h * value(u)) + wm * sum(h) (../codes.h:
// none where value(u) holds the offset, as INT8's q = u - 128, taken signed so that nothing cancels).
template <class D>
void gemm_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  using C = typename D::Codes;
  const int64_t pbytes = panel_bytes(D::kMethod, group, K);
  const int64_t gbytes = group_bytes(D::kMethod, group);
  const int64_t wbytes = group_weight_bytes(D::kMethod, group);
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* panel = panels + p * pbytes;
    for (int i = 0; i < m; ++i) {
      float acc[kPanelWidth] = {};
      for (int64_t gi = 0; gi < K / group; ++gi) {
        const uint8_t* w = panel + gi * gbytes;
        float hsum = 0.0f;
        for (int k = 0; k < group; ++k) hsum += bf16_to_float(*bf16_at(a, i, gi * group + k));
        for (int n = 0; n < kPanelWidth; ++n) {
          float d = 0.0f;
          for (int k = 0; k < group; ++k) {
            const int q = code_value<C>(packed_code<C>(w, group, n, k));
            d += bf16_to_float(*bf16_at(a, i, gi * group + k)) * static_cast<float>(q);
          }
          const auto [ws, wm] = D::template scales<Lanes>(w + wbytes, n);
          acc[n] += ws * d;
          acc[n] = plus_value_offset<C>(acc[n], wm, hsum);
        }
      }
      for (int n = 0; n < kPanelWidth; ++n) c[i * ldc + p * kPanelWidth + n] = acc[n];
    }
  }
}

}  // namespace kt::kernels::scalar
