// Portable twin of every bf16 kernel: the reference the SIMD families are tested against.
#include <cstdint>

#include "../../kernels/activations.h"
#include "kt/float_types.h"
#include "kt/quant_types.h"

namespace kt::kernels::scalar {

void gemm_bf16(int m, int64_t K, int, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  const int64_t pbytes = panel_bytes(Method::kBf16, kKAlign, K);
  for (int p = 0; p < npanels; ++p) {
    const auto* w = reinterpret_cast<const uint16_t*>(panels + p * pbytes);
    for (int i = 0; i < m; ++i) {
      float acc[kPanelWidth] = {};
      for (int64_t k2 = 0; k2 < K / 2; ++k2) {  // one VNNI row: 16 channels x 2 K-values
        const uint16_t* x = bf16_at(a, i, 2 * k2);
        const float a0 = bf16_to_float(x[0]), a1 = bf16_to_float(x[1]);
        const uint16_t* row = w + k2 * kPanelWidth * 2;
        for (int n = 0; n < kPanelWidth; ++n)
          acc[n] += a0 * bf16_to_float(row[2 * n]) + a1 * bf16_to_float(row[2 * n + 1]);
      }
      for (int n = 0; n < kPanelWidth; ++n) c[i * ldc + p * kPanelWidth + n] = acc[n];
    }
  }
}

}  // namespace kt::kernels::scalar
