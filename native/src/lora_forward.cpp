// The fine-tuning forward's steps (lora_steps.h), in the order SftMoe::forward_task runs them.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kt/float_types.h"
#include "lora_steps.h"

namespace kt::sft {

// Routing (worker 0): the batch as one chunk, and the saved buffers and the pools' partial outputs
// sized for its rows.
void ForwardSteps::route() const {
  start();
  step([&] {
    const MoeConfig& c = layer.config();
    s.tokens = args.tokens, s.top_k = c.top_k;
    route_rows({args.expert_ids, args.ids_int64, args.weights, args.skip_mask}, 0, args.tokens, c.top_k,
               c.num_experts, nullptr, s);
    const int64_t R = s.rows = s.offsets[c.num_experts];
    const int r = d.r;
    s.x.resize(R * d.Hp), s.xa.assign(R * 2 * r, 0.0f), s.g.resize(R * d.Ip), s.u.resize(R * d.Ip);
    s.h.resize(R * d.Ip), s.ha.assign(R * r, 0.0f);
    size_pools(R * d.H16);
  });
}

// 1. Per expert: the gathered rows of x and x A^T of gate and up.
void ForwardSteps::gather_inputs(const WorkerContext& ctx) const {
  step([&] {
    const int r = d.r;
    WorkerScratch& sc = worker_scratch();
    for_each_item(ws.counters[0][0].value, static_cast<int64_t>(s.active.size()), [&](int64_t a) {
      const int e = s.active[a];
      const int64_t r0 = s.offsets[e], n = s.offsets[e + 1] - r0;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t* row = s.x.data() + (r0 + i) * d.Hp;
        std::memcpy(row, args.hidden + s.row_token[r0 + i] * d.H, d.H * 2);
        std::fill(row + d.H, row + d.Hp, uint16_t{0});
      }
      if (!lora) return;
      grow(sc.w0, 2 * r * d.H), grow(sc.rows0, d.H);
      load_f32(L.weight[kGateA], L.dtype, e * r * d.H, r, d.H, d.H, false, sc.w0.data(), d.H);
      load_f32(L.weight[kUpA], L.dtype, e * r * d.H, r, d.H, d.H, false, sc.w0.data() + r * d.H, d.H);
      for (int64_t i = 0; i < n; ++i) {
        ops().bf16_row_to_float(s.x.data() + (r0 + i) * d.Hp, d.H, sc.rows0.data());
        ops().gemm_nt(1, 2 * r, d.H, 1.0f, sc.rows0.data(), d.H, sc.w0.data(), d.H,
                      s.xa.data() + (r0 + i) * 2 * r, 2 * r);
      }
    });
  });
}

// 2. Gate and up per pool and run of blocks of intermediate channels (+ s xa B^T), then h. A run
// of blocks is one GEMM call: one pass over the expert's rows for several blocks' weights.
void ForwardSteps::gate_up(const WorkerContext& ctx) const {
  step([&] {
    const int r = d.r;
    const Method method = layer.config().method;
    const GemmA16Fn gemm = table().method(method).gemm_a16;
    const MoeLayer::PackedSlice ps = layer.packed_slice(ctx.pool);
    const int64_t blocks = (ps.i_end - ps.i_begin) / d.width;
    const int64_t runs = (blocks + kGateUpRunBlocks - 1) / kGateUpRunBlocks;
    const int64_t panel = panel_bytes(method, d.G, d.Hp);
    WorkerScratch& sc = worker_scratch();
    grow(sc.c, kMaxCallRows * 2 * d.width * kGateUpRunBlocks),
        grow(sc.w0, 2 * r * d.width * kGateUpRunBlocks);
    const int64_t nactive = static_cast<int64_t>(s.active.size());
    for_each_item(ws.counters[1][ctx.pool].value, nactive * runs, [&](int64_t item) {
      const int e = s.active[item / runs];
      const int64_t b0 = item % runs * kGateUpRunBlocks, nb = std::min(kGateUpRunBlocks, blocks - b0);
      const int64_t i0 = ps.i_begin + b0 * d.width, cols = nb * d.width, ldc = 2 * cols;
      float* bt_gate = sc.w0.data();  // B's rows [i0, i0 + cols) transposed, [r, cols], zero past I
      float* bt_up = sc.w0.data() + r * cols;
      if (lora) {
        const int64_t lora_rows = std::clamp<int64_t>(d.I - i0, 0, cols);
        std::fill(sc.w0.begin(), sc.w0.begin() + 2 * r * cols, 0.0f);
        load_f32(L.weight[kGateB], L.dtype, (e * d.I + i0) * r, lora_rows, r, r, true, bt_gate, cols);
        load_f32(L.weight[kUpB], L.dtype, (e * d.I + i0) * r, lora_rows, r, r, true, bt_up, cols);
      }
      const uint8_t* w = ps.gate_up + e * ps.gate_up_bytes + b0 * 2 * (d.width / kPanelWidth) * panel;
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0));
        for (int i = 0; i < m; ++i) sc.ptrs[i] = s.x.data() + (r0 + i) * d.Hp;
        gemm(m, d.Hp, d.G, Bf16Rows{sc.ptrs.data(), kChunkBytes}, w, static_cast<int>(ldc / kPanelWidth),
             sc.c.data(), ldc);
        const float* xa = s.xa.data() + r0 * 2 * r;
        for (int64_t bb = 0; bb < nb; ++bb) {
          float* cg = sc.c.data() + bb * 2 * d.width;  // the block's gate columns, then its up columns
          if (lora) {
            ops().gemm_nn(m, d.width, r, d.scale, xa, 2 * r, bt_gate + bb * d.width, cols, cg, ldc);
            ops().gemm_nn(m, d.width, r, d.scale, xa + r, 2 * r, bt_up + bb * d.width, cols, cg + d.width,
                          ldc);
          }
          for (int i = 0; i < m; ++i) {
            const int64_t at = (r0 + i) * d.Ip + i0 + bb * d.width;
            std::memcpy(s.g.data() + at, cg + i * ldc, d.width * 4);
            std::memcpy(s.u.data() + at, cg + i * ldc + d.width, d.width * 4);
            table().silu_mul(s.g.data() + at, s.u.data() + at, d.width, s.h.data() + at);
          }
        }
      }
    });
  });
}

// 3. ha = h A_down^T per expert (with adapters only).
void ForwardSteps::down_a(const WorkerContext& ctx) const {
  step([&] {
    const int r = d.r;
    WorkerScratch& sc = worker_scratch();
    grow(sc.w0, r * d.I), grow(sc.rows0, d.I);
    for_each_item(ws.counters[2][0].value, static_cast<int64_t>(s.active.size()), [&](int64_t a) {
      const int e = s.active[a];
      load_f32(L.weight[kDownA], L.dtype, e * r * d.I, r, d.I, d.I, false, sc.w0.data(), d.I);
      for (int64_t row = s.offsets[e]; row < s.offsets[e + 1]; ++row) {
        ops().bf16_row_to_float(s.h.data() + row * d.Ip, d.I, sc.rows0.data());
        ops().gemm_nt(1, r, d.I, 1.0f, sc.rows0.data(), d.I, sc.w0.data(), d.I, s.ha.data() + row * r, r);
      }
    });
  });
}

// 4. Down per pool and run of output panels: each pool's partial y (+ s ha B_down^T on one pool).
void ForwardSteps::down(const WorkerContext& ctx) const {
  step([&] {
    const int r = d.r;
    const Method method = layer.config().method;
    const GemmA16Fn gemm = table().method(method).gemm_a16;
    const MoeLayer::PackedSlice ps = layer.packed_slice(ctx.pool);
    const int64_t slice = ps.i_end - ps.i_begin;
    if (slice == 0) return;
    const int64_t panels = d.H16 / kPanelWidth, runs = (panels + kDownRunPanels - 1) / kDownRunPanels;
    const int64_t panel = panel_bytes(method, d.G, slice);
    const bool add_lora = lora && ctx.pool == d.lora_pool;
    float* y = ws.y[ctx.pool].data();
    WorkerScratch& sc = worker_scratch();
    grow(sc.w0, r * kDownRunPanels * kPanelWidth);
    const int64_t nactive = static_cast<int64_t>(s.active.size());
    for_each_item(ws.counters[3][ctx.pool].value, nactive * runs, [&](int64_t item) {
      const int e = s.active[item / runs];
      const int64_t p0 = item % runs * kDownRunPanels, np = std::min<int64_t>(kDownRunPanels, panels - p0);
      const int64_t c0 = p0 * kPanelWidth, cols = np * kPanelWidth;
      if (add_lora) {  // B_down's rows [c0, c0 + cols) transposed, [r, cols], zero past H
        std::fill(sc.w0.begin(), sc.w0.begin() + r * cols, 0.0f);
        load_f32(L.weight[kDownB], L.dtype, (e * d.H + c0) * r, std::clamp<int64_t>(d.H - c0, 0, cols), r, r,
                 true, sc.w0.data(), cols);
      }
      const uint8_t* w = ps.down + e * ps.down_bytes + p0 * panel;
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0));
        for (int i = 0; i < m; ++i) sc.ptrs[i] = s.h.data() + (r0 + i) * d.Ip + ps.i_begin;
        float* out = y + r0 * d.H16 + c0;
        gemm(m, slice, d.G, Bf16Rows{sc.ptrs.data(), kChunkBytes}, w, static_cast<int>(np), out, d.H16);
        if (add_lora)
          ops().gemm_nn(m, cols, r, d.scale, s.ha.data() + r0 * r, r, sc.w0.data(), cols, out, d.H16);
      }
    });
  });
}

// 5. out[t] = sum over the token's rows, in slot order, of weight * (sum of the pools' parts).
void ForwardSteps::combine(const WorkerContext& ctx) const {
  step([&] {
    WorkerScratch& sc = worker_scratch();
    grow(sc.rows0, d.H);
    const int64_t T = s.tokens, per_item = 8;
    for_each_item(ws.counters[4][0].value, (T + per_item - 1) / per_item, [&](int64_t item) {
      for (int64_t t = item * per_item; t < std::min(T, (item + 1) * per_item); ++t) {
        std::fill(sc.rows0.begin(), sc.rows0.begin() + d.H, 0.0f);
        for (int k = 0; k < d.top_k; ++k) {
          const int64_t row = s.slot_row[t * d.top_k + k];
          if (row < 0) continue;
          for (int p = 0; p < d.P; ++p)
            if (layer.packed_slice(p).i_end > layer.packed_slice(p).i_begin)
              table().add_weighted(sc.rows0.data(), ws.y[p].data() + row * d.H16, s.row_weight[row], d.H);
        }
        for (int64_t j = 0; j < d.H; ++j) args.out[t * d.H + j] = float_to_bf16(sc.rows0[j]);
      }
    });
  });
}

}  // namespace kt::sft
