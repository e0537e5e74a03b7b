// Portable twin of the FP8 GEMM: e4m3 decoded exactly, fp32 sums per group, times the group's
// channel scales.
#include <cstdint>

#include "../../kernels/activations.h"
#include "fp8.h"

namespace kt::kernels::scalar {

void gemm_fp8(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  float table[256];
  for (int b = 0; b < 256; ++b) table[b] = e4m3_to_float(static_cast<uint8_t>(b));
  const int64_t pbytes = panel_bytes(Method::kFp8, group, K);
  const int64_t gbytes = group_bytes(Method::kFp8, group), wbytes = group_weight_bytes(Method::kFp8, group);
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* panel = panels + p * pbytes;
    for (int i = 0; i < m; ++i) {
      float acc[kPanelWidth] = {};
      for (int64_t gi = 0; gi < K / group; ++gi) {
        const uint8_t* w = panel + gi * gbytes;
        float sum[kPanelWidth] = {};
        for (int r = 0; r < group / 2; ++r) {  // one packed row: 16 channels x 2 K-values
          const uint16_t* x = bf16_at(a, i, gi * group + 2 * r);
          const float a0 = bf16_to_float(x[0]), a1 = bf16_to_float(x[1]);
          for (int n = 0; n < kPanelWidth; ++n)
            sum[n] += a0 * table[w[fp8::packed_offset(r, n, 0)]] + a1 * table[w[fp8::packed_offset(r, n, 1)]];
        }
        const auto* scale = reinterpret_cast<const float*>(w + wbytes);
        for (int n = 0; n < kPanelWidth; ++n) acc[n] += scale[n] * sum[n];
      }
      for (int n = 0; n < kPanelWidth; ++n) c[i * ldc + p * kPanelWidth + n] = acc[n];
    }
  }
}

}  // namespace kt::kernels::scalar
