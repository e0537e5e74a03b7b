// Element-wise steps around the GEMMs, exact fp32: the twins of the SIMD versions.
#include <cmath>
#include <cstdint>

#include "kt/float_types.h"
#include "kt/kernels.h"

namespace kt::kernels::scalar {

void silu_mul(const float* gate, const float* up, int64_t n, uint16_t* h) {
  for (int64_t i = 0; i < n; ++i) h[i] = float_to_bf16(gate[i] / (1.0f + std::exp(-gate[i])) * up[i]);
}

void add_weighted(float* y, const float* c, float weight, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += weight * c[i];
}

void sum_to_bf16(const float* const* parts, int nparts, int64_t n, bool accumulate, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    float v = accumulate ? bf16_to_float(out[i]) : 0.0f;
    for (int p = 0; p < nparts; ++p) v += parts[p][i];
    out[i] = float_to_bf16(v);
  }
}

}  // namespace kt::kernels::scalar
