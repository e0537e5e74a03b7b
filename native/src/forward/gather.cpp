// The gather step (forward.h): each token's input, quantized once for all its experts (int8_x),
// into each of its rows in the tiled layout; the client's units beside it.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "forward/forward.h"
#include "forward/rows.h"
#include "kt/float_types.h"
#include "kt/quantize.h"

namespace kt {

// Units [0, token_units): runs of tokens; then the client's.
void ForwardTask::gather_unit(int64_t unit) {
  if (unit < plan_.token_units) {
    const int64_t t0 = unit * plan_.tokens_per_unit;
    gather_tokens(t0, std::min(chunk_.Tc, t0 + plan_.tokens_per_unit));
  } else {
    guarded(layer_.runner(), ws_.failed, [&] { client_->gather_unit(unit - plan_.token_units); });
  }
}

// Tokens [t0, t1) of the chunk, their partial sums cleared.
void ForwardTask::gather_tokens(int64_t t0, int64_t t1) {
  MoeWorkspace& ws = ws_;
  const Chunk& c = chunk_;
  guarded(layer_.runner(), ws.failed, [&] {
    thread_local std::vector<float> row;
    thread_local std::vector<uint16_t> padded;
    grow(row, c.Hp), grow(padded, c.Hp);
    const int64_t H = c.H, Hp = c.Hp, K = c.K;
    const int64_t H_whole = H / (kChunkBytes / 2) * (kChunkBytes / 2);  // bf16 values in whole chunks
    const bool per_row =
        method_traits(layer_.config().method).gate_up_input_per_row || layer_.config().int8_input_per_row;
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* x = args_.hidden + (c.c0 + t) * H;
      if (c.int8_x) {
        for (int64_t i = 0; i < H; ++i) row[i] = bf16_to_float(x[i]);
        std::fill(row.begin() + H, row.begin() + Hp, 0.0f);
        quantize_activation_row(row.data(), Hp, c.G, per_row, ws.x_q.data() + t * Hp,
                                ws.x_scale.data() + t * (Hp / c.G), ws.x_sum.data() + t * (Hp / c.G));
      }
      if (!ws.down_rows)
        for (int p = 0; p < c.P; ++p) std::fill_n(ws.pools[p].y.data() + t * c.Hy, c.Hy, 0.0f);
      for (int j = 0; j < K; ++j) {
        const int64_t r = ws.slot_row[t * K + j];
        if (r < 0) continue;
        const int e = ws.row_expert[r];
        if (c.int8_x && !ws.a16[e]) {
          store_tiled(tiled_row(ws.x_rows.data(), r + padding_before(ws, e), Hp), 0, ws.x_q.data() + t * Hp,
                      Hp);
          continue;
        }
        // Whole chunks straight from the input; the last, zero-padded ones through `padded`.
        uint8_t* dst =
            tiled_row(c.int8_x ? ws.x_rows16.data() : ws.x_rows.data(), r + padding_before(ws, e), Hp * 2);
        store_tiled(dst, 0, x, H_whole * 2);
        if (H_whole < Hp) {
          std::copy(x + H_whole, x + H, padded.begin());
          std::fill(padded.begin() + (H - H_whole), padded.begin() + (Hp - H_whole), uint16_t{0});
          store_tiled(dst, H_whole * 2, padded.data(), (Hp - H_whole) * 2);
        }
      }
    }
  });
}

}  // namespace kt
