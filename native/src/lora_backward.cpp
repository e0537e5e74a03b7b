// The fine-tuning backward's steps (lora_steps.h), in the order SftMoe::backward_task runs them.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/transposed_gemm.h"
#include "kt/float_types.h"
#include "lora_steps.h"

namespace kt::sft {

namespace {

// Where each adapter's gradient sits in one expert's block of WorkerScratch::grads, and its size:
// A_gate, A_up [r, H]; B_gate, B_up, B_down transposed, [r, I] and [r, H]; A_down [r, I].
struct GradLayout {
  int64_t at[kNumLoraTensors + 1];
  int64_t size[kNumLoraTensors];
  GradLayout(int64_t r, int64_t H, int64_t I) : size{r * H, I * r, r * H, I * r, r * I, H * r} {
    at[0] = 0;
    for (int t = 0; t < kNumLoraTensors; ++t) at[t + 1] = at[t] + size[t];
  }
};

}  // namespace

// Worker 0: the backward's buffers for the saved forward's rows.
void BackwardSteps::size_buffers() const {
  start();
  step([&] {
    const int64_t R = s.rows, r = d.r;
    ws.dy.resize(R * d.Hp), ws.dyb.assign(R * r, 0.0f), ws.dhu.resize(R * d.Ip);
    ws.dg.resize(R * d.Ip), ws.du.resize(R * d.Ip), ws.dgu.resize(R * 2 * d.Ip);
    ws.dgub.assign(R * 2 * r, 0.0f), ws.dweight.assign(R, 0.0f);
    size_pools(R * d.Hp);
  });
}

// 1. Gather dY per row; dyb = dY B_down.
void BackwardSteps::gather_grad_out(const WorkerContext& ctx) const {
  step([&] {
    const int r = d.r;
    WorkerScratch& sc = worker_scratch();
    for_each_item(ws.counters[0][0].value, static_cast<int64_t>(s.active.size()), [&](int64_t a) {
      const int e = s.active[a];
      for (int64_t row = s.offsets[e]; row < s.offsets[e + 1]; ++row) {
        uint16_t* dst = ws.dy.data() + row * d.Hp;
        std::memcpy(dst, args.grad_out + s.row_token[row] * d.H, d.H * 2);
        std::fill(dst + d.H, dst + d.Hp, uint16_t{0});
      }
      if (!lora) return;
      grow(sc.w0, d.H * r), grow(sc.rows0, d.H);
      load_f32(L.weight[kDownB], L.dtype, e * d.H * r, d.H, r, r, true, sc.w0.data(), d.H);  // [r, H]
      for (int64_t row = s.offsets[e]; row < s.offsets[e + 1]; ++row) {
        ops().bf16_row_to_float(ws.dy.data() + row * d.Hp, d.H, sc.rows0.data());
        ops().gemm_nt(1, r, d.H, 1.0f, sc.rows0.data(), d.H, sc.w0.data(), d.H, ws.dyb.data() + row * r, r);
      }
    });
  });
}

// 2. dhu = dY W_down + s dyb A_down, per pool and 64 intermediate channels.
void BackwardSteps::down_transposed(const WorkerContext& ctx) const {
  step([&] {
    const int r = d.r;
    const MoeLayer::PackedSlice ps = layer.packed_slice(ctx.pool);
    const int64_t slice = ps.i_end - ps.i_begin, blocks = slice / kTransposedBlock;
    WorkerScratch& sc = worker_scratch();
    grow(sc.w0, r * kTransposedBlock);
    const int64_t nactive = static_cast<int64_t>(s.active.size());
    for_each_item(ws.counters[1][ctx.pool].value, nactive * blocks, [&](int64_t item) {
      const int e = s.active[item / blocks];
      const int64_t k0 = item % blocks * kTransposedBlock, col0 = ps.i_begin + k0;
      if (lora) {
        std::fill(sc.w0.begin(), sc.w0.begin() + r * kTransposedBlock, 0.0f);
        load_f32(L.weight[kDownA], L.dtype, e * r * d.I + col0, r,
                 std::clamp<int64_t>(d.I - col0, 0, kTransposedBlock), d.I, false, sc.w0.data(),
                 kTransposedBlock);
      }
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0));
        for (int i = 0; i < m; ++i) sc.ptrs[i] = ws.dy.data() + (r0 + i) * d.Hp;
        float* out = ws.dhu.data() + r0 * d.Ip + col0;
        gemm_transposed(table(), layer.config().method, d.G, ps.down + e * ps.down_bytes, d.H16, slice, k0, m,
                        sc.ptrs.data(), out, d.Ip);
        if (lora)
          ops().gemm_nn(m, kTransposedBlock, r, d.scale, ws.dyb.data() + r0 * r, r, sc.w0.data(),
                        kTransposedBlock, out, d.Ip);
      }
    });
  });
}

// 3. Per expert: d weight, dg and du, the adapters' gradients, dgb and dub.
void BackwardSteps::expert_grads(const WorkerContext& ctx) const {
  step([&] {
    WorkerScratch& sc = worker_scratch();
    const int64_t r = d.r, H = d.H, I = d.I;
    const GradLayout grad(r, H, I);
    for_each_item(ws.counters[2][0].value, static_cast<int64_t>(s.active.size()), [&](int64_t a) {
      const int e = s.active[a];
      grow(sc.grads, grad.at[kNumLoraTensors]);
      if (lora) {
        std::fill(sc.grads.begin(), sc.grads.begin() + grad.at[kNumLoraTensors], 0.0f);
        grow(sc.w1, 2 * I * r);  // B_gate, B_up transposed, [r, I] each
        load_f32(L.weight[kGateB], L.dtype, e * I * r, I, r, r, true, sc.w1.data(), I);
        load_f32(L.weight[kUpB], L.dtype, e * I * r, I, r, r, true, sc.w1.data() + I * r, I);
      }
      float* g = sc.grads.data();
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int64_t m = std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0);
        gate_backward(r0, m, sc);
        if (!lora) continue;
        down_adapter_grads(r0, m, sc, g + grad.at[kDownA], g + grad.at[kDownB]);
        gate_up_adapter_grads(r0, m, sc, g + grad.at[kGateA], g + grad.at[kGateB], g + grad.at[kUpA],
                              g + grad.at[kUpB]);
      }
      if (lora)
        for (int t = 0; t < kNumLoraTensors; ++t) {
          const bool transposed = t == kGateB || t == kUpB || t == kDownB;  // computed as [r, rows]
          add_into(L.grad[t], L.dtype, e * grad.size[t], g + grad.at[t], grad.size[t], transposed ? r : 0);
        }
    });
  });
}

// Rows [r0, r0 + m) of one expert: d weight = <dhu, h>; dh = weight dhu; dg, du through silu(g) u,
// and their bf16 copy in blocks as the packed gate/up (gate's, then up's). Leaves h in fp32 in
// sc.rows0 ([m, Ip]).
void BackwardSteps::gate_backward(int64_t r0, int64_t m, WorkerScratch& sc) const {
  const int64_t H = d.H, Ip = d.Ip;
  grow(sc.rows0, m * std::max(Ip, H)), grow(sc.rows1, m * std::max(Ip, H));
  grow(sc.c, std::max<int64_t>(kMaxCallRows * d.r, 2 * Ip));
  float* hf = sc.rows0.data();  // h rows, fp32 [m, Ip]
  for (int64_t i = 0; i < m; ++i) {
    const int64_t row = r0 + i;
    ops().bf16_row_to_float(s.h.data() + row * Ip, Ip, hf + i * Ip);
    const float* dhu = ws.dhu.data() + row * Ip;
    float dw = 0.0f;
    for (int64_t j = 0; j < Ip; ++j) dw += dhu[j] * hf[i * Ip + j];
    ws.dweight[row] = dw;
    const float w = s.row_weight[row];
    float* dh = sc.c.data();
    for (int64_t j = 0; j < Ip; ++j) dh[j] = w * dhu[j];
    float* dg = ws.dg.data() + row * Ip;
    float* du = ws.du.data() + row * Ip;
    ops().silu_mul_backward(s.g.data() + row * Ip, s.u.data() + row * Ip, dh, Ip, dg, du);
    uint16_t* dgu = ws.dgu.data() + row * 2 * Ip;
    for (int64_t b = 0; b < Ip; b += d.width)
      for (int64_t j = 0; j < d.width; ++j) {
        dgu[2 * b + j] = float_to_bf16(dg[b + j]);
        dgu[2 * b + d.width + j] = float_to_bf16(du[b + j]);
      }
  }
}

// Down's adapters: dA += s (w dyb)^T h, dB += s (w dY)^T ha (dB transposed, [r, H]).
void BackwardSteps::down_adapter_grads(int64_t r0, int64_t m, WorkerScratch& sc, float* g_da,
                                       float* g_db) const {
  const int r = d.r;
  const int64_t H = d.H;
  float* wdyb = sc.c.data();
  float* wdy = sc.rows1.data();
  for (int64_t i = 0; i < m; ++i) {
    const float w = s.row_weight[r0 + i];
    for (int j = 0; j < r; ++j) wdyb[i * r + j] = w * ws.dyb[(r0 + i) * r + j];
    ops().bf16_row_to_float(ws.dy.data() + (r0 + i) * d.Hp, H, wdy + i * H);
    for (int64_t j = 0; j < H; ++j) wdy[i * H + j] *= w;
  }
  ops().gemm_tn(r, d.I, m, d.scale, wdyb, r, sc.rows0.data(), d.Ip, g_da, d.I);
  ops().gemm_tn(r, H, m, d.scale, s.ha.data() + r0 * r, r, wdy, H, g_db, H);
}

// Gate's and up's adapters: dB += s dg^T xa (transposed, [r, I]), dgb = dg B, dA += s dgb^T x; the
// same for up.
void BackwardSteps::gate_up_adapter_grads(int64_t r0, int64_t m, WorkerScratch& sc, float* g_ga, float* g_gb,
                                          float* g_ua, float* g_ub) const {
  const int r = d.r;
  const int64_t H = d.H, I = d.I, Ip = d.Ip;
  const float* dg = ws.dg.data() + r0 * Ip;
  const float* du = ws.du.data() + r0 * Ip;
  const float* xa = s.xa.data() + r0 * 2 * r;
  float* dgub = ws.dgub.data() + r0 * 2 * r;
  ops().gemm_tn(r, I, m, d.scale, xa, 2 * r, dg, Ip, g_gb, I);
  ops().gemm_tn(r, I, m, d.scale, xa + r, 2 * r, du, Ip, g_ub, I);
  ops().gemm_nt(m, r, I, 1.0f, dg, Ip, sc.w1.data(), I, dgub, 2 * r);
  ops().gemm_nt(m, r, I, 1.0f, du, Ip, sc.w1.data() + I * r, I, dgub + r, 2 * r);
  float* xf = sc.rows1.data();  // x rows, fp32 [m, H]
  for (int64_t i = 0; i < m; ++i) ops().bf16_row_to_float(s.x.data() + (r0 + i) * d.Hp, H, xf + i * H);
  ops().gemm_tn(r, H, m, d.scale, dgub, 2 * r, xf, H, g_ga, H);
  ops().gemm_tn(r, H, m, d.scale, dgub + r, 2 * r, xf, H, g_ua, H);
}

// 4. dx = dg W_gate + du W_up (+ s (dgb A_gate + dub A_up) on one pool), per pool and 64 hidden
// channels.
void BackwardSteps::gate_up_transposed(const WorkerContext& ctx) const {
  step([&] {
    const int r = d.r;
    const MoeLayer::PackedSlice ps = layer.packed_slice(ctx.pool);
    const int64_t slice = ps.i_end - ps.i_begin, blocks = d.Hp / kTransposedBlock;
    if (slice == 0) return;
    const bool add_lora = lora && ctx.pool == d.lora_pool;
    float* dx = ws.y[ctx.pool].data();
    WorkerScratch& sc = worker_scratch();
    grow(sc.w0, 2 * r * kTransposedBlock);
    const int64_t nactive = static_cast<int64_t>(s.active.size());
    for_each_item(ws.counters[3][ctx.pool].value, nactive * blocks, [&](int64_t item) {
      const int e = s.active[item / blocks];
      const int64_t k0 = item % blocks * kTransposedBlock;
      if (add_lora) {
        const int64_t cols = std::clamp<int64_t>(d.H - k0, 0, kTransposedBlock);
        std::fill(sc.w0.begin(), sc.w0.begin() + 2 * r * kTransposedBlock, 0.0f);
        load_f32(L.weight[kGateA], L.dtype, e * r * d.H + k0, r, cols, d.H, false, sc.w0.data(),
                 kTransposedBlock);
        load_f32(L.weight[kUpA], L.dtype, e * r * d.H + k0, r, cols, d.H, false,
                 sc.w0.data() + r * kTransposedBlock, kTransposedBlock);
      }
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0));
        for (int i = 0; i < m; ++i) sc.ptrs[i] = ws.dgu.data() + (r0 + i) * 2 * d.Ip + 2 * ps.i_begin;
        float* out = dx + r0 * d.Hp + k0;
        gemm_transposed(table(), layer.config().method, d.G, ps.gate_up + e * ps.gate_up_bytes, 2 * slice,
                        d.Hp, k0, m, sc.ptrs.data(), out, d.Hp);
        if (add_lora) {
          const float* dgub = ws.dgub.data() + r0 * 2 * r;
          const float* a = sc.w0.data();
          ops().gemm_nn(m, kTransposedBlock, r, d.scale, dgub, 2 * r, a, kTransposedBlock, out, d.Hp);
          ops().gemm_nn(m, kTransposedBlock, r, d.scale, dgub + r, 2 * r, a + r * kTransposedBlock,
                        kTransposedBlock, out, d.Hp);
        }
      }
    });
  });
}

// 5. Per token: grad_in = the sum of its rows' dx (slot order, then pools), its slots' d weight.
void BackwardSteps::combine(const WorkerContext& ctx) const {
  step([&] {
    const int64_t T = s.tokens, per_item = 8;
    for_each_item(ws.counters[4][0].value, (T + per_item - 1) / per_item, [&](int64_t item) {
      for (int64_t t = item * per_item; t < std::min(T, (item + 1) * per_item); ++t) {
        float* gi = args.grad_in + t * d.H;
        std::fill(gi, gi + d.H, 0.0f);
        for (int k = 0; k < d.top_k; ++k) {
          const int64_t row = s.slot_row[t * d.top_k + k];
          args.grad_weights[t * d.top_k + k] = row < 0 ? 0.0f : ws.dweight[row];
          if (row < 0) continue;
          for (int p = 0; p < d.P; ++p)
            if (layer.packed_slice(p).i_end > layer.packed_slice(p).i_begin)
              table().add_weighted(gi, ws.y[p].data() + row * d.Hp, 1.0f, d.H);
        }
      }
    });
  });
}

}  // namespace kt::sft
