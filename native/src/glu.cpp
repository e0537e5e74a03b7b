// The gated activations other than plain silu (moe_layer.h, GluConfig): biases, clamps and gpt-oss's
// form. One portable loop, cloned per ISA by the compiler and picked at load; plain silu keeps the
// table's hand-vectorized silu_mul.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kt/float_types.h"
#include "kt/kernels.h"

namespace kt {

__attribute__((target_clones("avx512f", "avx2", "default"))) void glu_general(
    const float* gate, const float* up, const float* gate_bias, const float* up_bias, int64_t n, int kind,
    float limit, float alpha, uint16_t* h) {
  const bool clamp = limit > 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float g = gate[i] + (gate_bias ? gate_bias[i] : 0.0f);
    float u = up[i] + (up_bias ? up_bias[i] : 0.0f);
    if (clamp) g = std::min(g, limit), u = std::clamp(u, -limit, limit);
    const float v =
        kind == 0 ? g / (1.0f + std::exp(-g)) * u : (u + 1.0f) * g / (1.0f + std::exp(-alpha * g));
    h[i] = float_to_bf16(v);
  }
}

}  // namespace kt
