// Portable twin of the quantized GEMMs (INT8 and INT4 share it; see ../epilogue.h).
#pragma once

#include <cstdint>

#include "../activations.h"
#include "../epilogue.h"
#include "kt/kernels.h"

namespace kt::kernels::scalar {

template <Method M>
void gemm_quant(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
                int64_t ldc) {
  static_assert(kIntegerMethod<M>, "the integer GEMM decodes the integer methods' weights only");
  static_assert(!kLookupNibbles<M>, "looked-up nibbles have no int8-input kernel");
  const int64_t pbytes = panel_bytes(M, group, K);
  const int64_t gbytes = group_bytes(M, group);
  const int64_t wbytes = group_weight_bytes(M, group);
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
            d += int32_t{*quant_at(a, i, gi * group + k)} * packed_weight<M>(w, group, n, k);
          const float ws = GroupScales<M>::scale(w + wbytes, n);
          const float wm = GroupScales<M>::offset(w + wbytes, n);
          acc[n] += static_cast<float>(d) * (sa * ws) + ssum * wm;
        }
      }
      for (int n = 0; n < kPanelWidth; ++n) c[i * ldc + p * kPanelWidth + n] = acc[n];
    }
  }
}

}  // namespace kt::kernels::scalar
