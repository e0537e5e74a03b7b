// The combine step (forward.h): the pools' partial outputs into the output.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "forward/forward.h"
#include "forward/rows.h"

namespace kt {

// A run of tokens' columns (`unit`: run * plan.splits + split): the pools' partial outputs
// (down_rows: each token's rows in slot order, weighted) summed into bf16, or fp32 (out_f32).
void ForwardTask::combine_item(int64_t unit) {
  const MoeWorkspace& ws = ws_;
  const Chunk& c = chunk_;
  const int64_t t0 = unit / plan_.splits * plan_.tokens_per_unit, h0 = unit % plan_.splits * plan_.width;
  const int64_t n = std::min(c.H, h0 + plan_.width) - h0;
  if (n <= 0) return;
  guarded(layer_.runner(), ws_.failed, [&] {
    thread_local std::vector<const float*> parts;
    thread_local std::vector<float> sum;
    grow(parts, c.P), grow(sum, c.Hy);
    for (int64_t t = t0; t < std::min(c.Tc, t0 + plan_.tokens_per_unit); ++t) {
      const int64_t at = (c.c0 + t) * c.H + h0;
      auto emit = [&](const float* const* p, int np) {
        if (!args_.out_f32) return table_.sum_to_bf16(p, np, n, args_.incremental, args_.out + at);
        float* out = args_.out_f32 + at;
        for (int64_t i = 0; i < n; ++i) {
          float s = args_.incremental ? out[i] : 0.0f;
          for (int q = 0; q < np; ++q) s += p[q][i];
          out[i] = s;
        }
      };
      if (ws.down_rows) {
        std::fill_n(sum.data(), n, 0.0f);
        for (int j = 0; j < c.K; ++j) {
          const int64_t r = ws.slot_row[t * c.K + j];
          if (r < 0) continue;
          for (int p = 0; p < c.P; ++p)
            if (plan_.pools[p].slice > 0)  // an empty slice stored nothing
              table_.add_weighted(
                  sum.data(), ws.pools[p].y.data() + (r + padding_before(ws, ws.row_expert[r])) * c.Hy + h0,
                  ws.row_weight[r], n);
        }
        parts[0] = sum.data();
        emit(parts.data(), 1);
      } else {
        for (int p = 0; p < c.P; ++p) parts[p] = ws.pools[p].y.data() + t * c.Hy + h0;
        emit(parts.data(), c.P);
      }
    }
  });
}

}  // namespace kt
