// Portable twin of the quantized GEMMs (INT8 and INT4 share it; see ../epilogue.h).
#pragma once

#include <cstdint>

#include "../activations.h"
#include "../epilogue.h"
#include "kt/kernels.h"
#include "lanes.h"

namespace kt::kernels::scalar {

template <class D>
void gemm_q8(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
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
        const float sa = a.scale[i][gi], ssum = a.scaled_sum[i][gi];
        for (int n = 0; n < kPanelWidth; ++n) {
          int32_t d = 0;
          for (int k = 0; k < group; ++k)
            d += int32_t{*quant_at(a, i, gi * group + k)} * packed_code<C>(w, group, n, k);
          const auto [ws, wm] = D::template scales<Lanes>(w + wbytes, n);
          acc[n] += static_cast<float>(d) * (sa * ws) + ssum * wm;
        }
      }
      for (int n = 0; n < kPanelWidth; ++n) c[i * ldc + p * kPanelWidth + n] = acc[n];
    }
  }
}

}  // namespace kt::kernels::scalar
