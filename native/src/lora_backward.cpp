// The fine-tuning backward's task (lora_tasks.h): its steps in order, then each step's unit.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include "kernels/transposed_gemm.h"
#include "kt/float_types.h"
#include "lora_tasks.h"

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

constexpr int64_t kCombineTokens = 8;  // tokens per unit of step 5

}  // namespace

BackwardTask::BackwardTask(const MoeLayer& layer, const LoraTensors& tensors, bool lora, const Shape& d,
                           SftMoe::Scratch& ws, const SftBackwardArgs& args,
                           std::shared_ptr<const SftSaved> saved)
    : layer_(layer),
      L_(tensors),
      lora_(lora),
      d_(d),
      ws_(ws),
      args_(args),
      saved_(std::move(saved)),
      s_(*saved_) {}

bool BackwardTask::next_step(StepShape& shape) {
  const int64_t active = static_cast<int64_t>(s_.active.size());
  auto any = [&](Step step, int64_t units) {
    step_ = step;
    shape.kind = StepShape::Kind::kAnyWorker;
    shape.units = units;
    return true;
  };
  // Per pool: `blocks(slice)` blocks of 64 channels per active expert.
  auto per_pool = [&](Step step, auto blocks) {
    step_ = step;
    shape.kind = StepShape::Kind::kPerPool;
    for (int p = 0; p < d_.P; ++p) {
      const MoeLayer::PackedSlice ps = layer_.packed_slice(p);
      shape.pool_units[p] = active * blocks(ps.i_end - ps.i_begin);
    }
    return true;
  };
  if (step_ == Step::kNone) return any(Step::kSize, 1);
  if (ws_.failed.load(std::memory_order_acquire)) return false;
  switch (step_) {
    case Step::kSize:
      return any(Step::kGatherGradOut, active);
    case Step::kGatherGradOut:
      return per_pool(Step::kDownTransposed, [](int64_t slice) { return slice / kTransposedBlock; });
    case Step::kDownTransposed:
      return any(Step::kExpertGrads, active);
    case Step::kExpertGrads:
      return per_pool(Step::kGateUpTransposed,
                      [&](int64_t slice) { return slice == 0 ? 0 : d_.Hp / kTransposedBlock; });
    case Step::kGateUpTransposed:
      return any(Step::kCombine, (s_.tokens + kCombineTokens - 1) / kCombineTokens);
    default:
      return false;
  }
}

void BackwardTask::run_unit(int64_t unit, const WorkerContext& ctx) {
  guarded(layer_.runner(), ws_.failed, [&] {
    switch (step_) {
      case Step::kSize:
        return size_buffers();
      case Step::kGatherGradOut:
        return gather_grad_out(unit);
      case Step::kDownTransposed:
        return down_transposed(ctx.pool, unit);
      case Step::kExpertGrads:
        return expert_grads(unit);
      case Step::kGateUpTransposed:
        return gate_up_transposed(ctx.pool, unit);
      case Step::kCombine:
        return combine(unit);
      case Step::kNone:
        return;
    }
  });
}

// The backward's buffers for the saved forward's rows.
void BackwardTask::size_buffers() {
  ws_.failed.store(false, std::memory_order_relaxed);
  const int64_t R = s_.rows, r = d_.r;
  ws_.dy.resize(R * d_.Hp), ws_.dyb.assign(R * r, 0.0f), ws_.dhu.resize(R * d_.Ip);
  ws_.dg.resize(R * d_.Ip), ws_.du.resize(R * d_.Ip), ws_.dgu.resize(R * 2 * d_.Ip);
  ws_.dgub.assign(R * 2 * r, 0.0f), ws_.dweight.assign(R, 0.0f);
  ws_.dx.resize(d_.P);
  for (auto& dx : ws_.dx) grow(dx, static_cast<size_t>(R * d_.Hp));
}

// 1. Active expert a: gather dY per row; dyb = dY B_down.
void BackwardTask::gather_grad_out(int64_t a) {
  const int r = d_.r;
  const int e = s_.active[a];
  for (int64_t row = s_.offsets[e]; row < s_.offsets[e + 1]; ++row) {
    uint16_t* dst = ws_.dy.data() + row * d_.Hp;
    std::memcpy(dst, args_.grad_out + s_.row_token[row] * d_.H, d_.H * 2);
    std::fill(dst + d_.H, dst + d_.Hp, uint16_t{0});
  }
  if (!lora_) return;
  WorkerScratch& sc = worker_scratch();
  grow(sc.w0, d_.H * r), grow(sc.rows0, d_.H);
  load_f32(L_.weight[kDownB], L_.dtype, e * d_.H * r, d_.H, r, r, true, sc.w0.data(), d_.H);  // [r, H]
  for (int64_t row = s_.offsets[e]; row < s_.offsets[e + 1]; ++row) {
    ops().bf16_row_to_float(ws_.dy.data() + row * d_.Hp, d_.H, sc.rows0.data());
    ops().gemm_nt(1, r, d_.H, 1.0f, sc.rows0.data(), d_.H, sc.w0.data(), d_.H, ws_.dyb.data() + row * r, r);
  }
}

// 2. dhu = dY W_down + s dyb A_down for one active expert and 64 intermediate channels of the pool.
void BackwardTask::down_transposed(int pool, int64_t item) {
  const int r = d_.r;
  const MoeLayer::PackedSlice ps = layer_.packed_slice(pool);
  const int64_t slice = ps.i_end - ps.i_begin, blocks = slice / kTransposedBlock;
  WorkerScratch& sc = worker_scratch();
  grow(sc.w0, r * kTransposedBlock);
  const int e = s_.active[item / blocks];
  const int64_t k0 = item % blocks * kTransposedBlock, col0 = ps.i_begin + k0;
  if (lora_) {
    std::fill(sc.w0.begin(), sc.w0.begin() + r * kTransposedBlock, 0.0f);
    load_f32(L_.weight[kDownA], L_.dtype, e * r * d_.I + col0, r,
             std::clamp<int64_t>(d_.I - col0, 0, kTransposedBlock), d_.I, false, sc.w0.data(),
             kTransposedBlock);
  }
  for (int64_t r0 = s_.offsets[e]; r0 < s_.offsets[e + 1]; r0 += kMaxCallRows) {
    const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s_.offsets[e + 1] - r0));
    for (int i = 0; i < m; ++i) sc.ptrs[i] = ws_.dy.data() + (r0 + i) * d_.Hp;
    float* out = ws_.dhu.data() + r0 * d_.Ip + col0;
    gemm_transposed(table(), layer_.config().method, d_.G, ps.down + e * ps.down_bytes, d_.H16, slice, k0, m,
                    sc.ptrs.data(), out, d_.Ip);
    if (lora_)
      ops().gemm_nn(m, kTransposedBlock, r, d_.scale, ws_.dyb.data() + r0 * r, r, sc.w0.data(),
                    kTransposedBlock, out, d_.Ip);
  }
}

// 3. Active expert a: d weight, dg and du, the adapters' gradients, dgb and dub.
void BackwardTask::expert_grads(int64_t a) {
  WorkerScratch& sc = worker_scratch();
  const int64_t r = d_.r, H = d_.H, I = d_.I;
  const GradLayout grad(r, H, I);
  const int e = s_.active[a];
  grow(sc.grads, grad.at[kNumLoraTensors]);
  if (lora_) {
    std::fill(sc.grads.begin(), sc.grads.begin() + grad.at[kNumLoraTensors], 0.0f);
    grow(sc.w1, 2 * I * r);  // B_gate, B_up transposed, [r, I] each
    load_f32(L_.weight[kGateB], L_.dtype, e * I * r, I, r, r, true, sc.w1.data(), I);
    load_f32(L_.weight[kUpB], L_.dtype, e * I * r, I, r, r, true, sc.w1.data() + I * r, I);
  }
  float* g = sc.grads.data();
  for (int64_t r0 = s_.offsets[e]; r0 < s_.offsets[e + 1]; r0 += kMaxCallRows) {
    const int64_t m = std::min<int64_t>(kMaxCallRows, s_.offsets[e + 1] - r0);
    gate_backward(r0, m, sc);
    if (!lora_) continue;
    down_adapter_grads(r0, m, sc, g + grad.at[kDownA], g + grad.at[kDownB]);
    gate_up_adapter_grads(r0, m, sc, g + grad.at[kGateA], g + grad.at[kGateB], g + grad.at[kUpA],
                          g + grad.at[kUpB]);
  }
  if (lora_)
    for (int t = 0; t < kNumLoraTensors; ++t) {
      const bool transposed = t == kGateB || t == kUpB || t == kDownB;  // computed as [r, rows]
      add_into(L_.grad[t], L_.dtype, e * grad.size[t], g + grad.at[t], grad.size[t], transposed ? r : 0);
    }
}

// Rows [r0, r0 + m) of one expert: d weight = <dhu, h>; dh = weight dhu; dg, du through silu(g) u,
// and their bf16 copy in blocks as the packed gate/up (gate's, then up's). Leaves h in fp32 in
// sc.rows0 ([m, Ip]).
void BackwardTask::gate_backward(int64_t r0, int64_t m, WorkerScratch& sc) const {
  const int64_t H = d_.H, Ip = d_.Ip;
  grow(sc.rows0, m * std::max(Ip, H)), grow(sc.rows1, m * std::max(Ip, H));
  grow(sc.c, std::max<int64_t>(kMaxCallRows * d_.r, 2 * Ip));
  float* hf = sc.rows0.data();  // h rows, fp32 [m, Ip]
  for (int64_t i = 0; i < m; ++i) {
    const int64_t row = r0 + i;
    ops().bf16_row_to_float(s_.h.data() + row * Ip, Ip, hf + i * Ip);
    const float* dhu = ws_.dhu.data() + row * Ip;
    float dw = 0.0f;
    for (int64_t j = 0; j < Ip; ++j) dw += dhu[j] * hf[i * Ip + j];
    ws_.dweight[row] = dw;
    const float w = s_.row_weight[row];
    float* dh = sc.c.data();
    for (int64_t j = 0; j < Ip; ++j) dh[j] = w * dhu[j];
    float* dg = ws_.dg.data() + row * Ip;
    float* du = ws_.du.data() + row * Ip;
    ops().silu_mul_backward(s_.g.data() + row * Ip, s_.u.data() + row * Ip, dh, Ip, dg, du);
    uint16_t* dgu = ws_.dgu.data() + row * 2 * Ip;
    for (int64_t b = 0; b < Ip; b += d_.width)
      for (int64_t j = 0; j < d_.width; ++j) {
        dgu[2 * b + j] = float_to_bf16(dg[b + j]);
        dgu[2 * b + d_.width + j] = float_to_bf16(du[b + j]);
      }
  }
}

// Down's adapters: dA += s (w dyb)^T h, dB += s (w dY)^T ha (dB transposed, [r, H]).
void BackwardTask::down_adapter_grads(int64_t r0, int64_t m, WorkerScratch& sc, float* g_da,
                                      float* g_db) const {
  const int r = d_.r;
  const int64_t H = d_.H;
  float* wdyb = sc.c.data();
  float* wdy = sc.rows1.data();
  for (int64_t i = 0; i < m; ++i) {
    const float w = s_.row_weight[r0 + i];
    for (int j = 0; j < r; ++j) wdyb[i * r + j] = w * ws_.dyb[(r0 + i) * r + j];
    ops().bf16_row_to_float(ws_.dy.data() + (r0 + i) * d_.Hp, H, wdy + i * H);
    for (int64_t j = 0; j < H; ++j) wdy[i * H + j] *= w;
  }
  ops().gemm_tn(r, d_.I, m, d_.scale, wdyb, r, sc.rows0.data(), d_.Ip, g_da, d_.I);
  ops().gemm_tn(r, H, m, d_.scale, s_.ha.data() + r0 * r, r, wdy, H, g_db, H);
}

// Gate's and up's adapters: dB += s dg^T xa (transposed, [r, I]), dgb = dg B, dA += s dgb^T x; the
// same for up.
void BackwardTask::gate_up_adapter_grads(int64_t r0, int64_t m, WorkerScratch& sc, float* g_ga, float* g_gb,
                                         float* g_ua, float* g_ub) const {
  const int r = d_.r;
  const int64_t H = d_.H, I = d_.I, Ip = d_.Ip;
  const float* dg = ws_.dg.data() + r0 * Ip;
  const float* du = ws_.du.data() + r0 * Ip;
  const float* xa = s_.xa.data() + r0 * 2 * r;
  float* dgub = ws_.dgub.data() + r0 * 2 * r;
  ops().gemm_tn(r, I, m, d_.scale, xa, 2 * r, dg, Ip, g_gb, I);
  ops().gemm_tn(r, I, m, d_.scale, xa + r, 2 * r, du, Ip, g_ub, I);
  ops().gemm_nt(m, r, I, 1.0f, dg, Ip, sc.w1.data(), I, dgub, 2 * r);
  ops().gemm_nt(m, r, I, 1.0f, du, Ip, sc.w1.data() + I * r, I, dgub + r, 2 * r);
  float* xf = sc.rows1.data();  // x rows, fp32 [m, H]
  for (int64_t i = 0; i < m; ++i)
    ops().bf16_row_to_float(s_.x.data() + s_.row_token[r0 + i] * H, H, xf + i * H);
  ops().gemm_tn(r, H, m, d_.scale, dgub, 2 * r, xf, H, g_ga, H);
  ops().gemm_tn(r, H, m, d_.scale, dgub + r, 2 * r, xf, H, g_ua, H);
}

// 4. dx = dg W_gate + du W_up (+ s (dgb A_gate + dub A_up) on one pool) for one active expert and
// 64 hidden channels of the pool's partial dx.
void BackwardTask::gate_up_transposed(int pool, int64_t item) {
  const int r = d_.r;
  const MoeLayer::PackedSlice ps = layer_.packed_slice(pool);
  const int64_t slice = ps.i_end - ps.i_begin, blocks = d_.Hp / kTransposedBlock;
  const bool add_lora = lora_ && pool == d_.lora_pool;
  float* dx = ws_.dx[pool].data();
  WorkerScratch& sc = worker_scratch();
  grow(sc.w0, 2 * r * kTransposedBlock);
  const int e = s_.active[item / blocks];
  const int64_t k0 = item % blocks * kTransposedBlock;
  if (add_lora) {
    const int64_t cols = std::clamp<int64_t>(d_.H - k0, 0, kTransposedBlock);
    std::fill(sc.w0.begin(), sc.w0.begin() + 2 * r * kTransposedBlock, 0.0f);
    load_f32(L_.weight[kGateA], L_.dtype, e * r * d_.H + k0, r, cols, d_.H, false, sc.w0.data(),
             kTransposedBlock);
    load_f32(L_.weight[kUpA], L_.dtype, e * r * d_.H + k0, r, cols, d_.H, false,
             sc.w0.data() + r * kTransposedBlock, kTransposedBlock);
  }
  for (int64_t r0 = s_.offsets[e]; r0 < s_.offsets[e + 1]; r0 += kMaxCallRows) {
    const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s_.offsets[e + 1] - r0));
    for (int i = 0; i < m; ++i) sc.ptrs[i] = ws_.dgu.data() + (r0 + i) * 2 * d_.Ip + 2 * ps.i_begin;
    float* out = dx + r0 * d_.Hp + k0;
    gemm_transposed(table(), layer_.config().method, d_.G, ps.gate_up + e * ps.gate_up_bytes, 2 * slice,
                    d_.Hp, k0, m, sc.ptrs.data(), out, d_.Hp);
    if (add_lora) {
      const float* dgub = ws_.dgub.data() + r0 * 2 * r;
      const float* a = sc.w0.data();
      ops().gemm_nn(m, kTransposedBlock, r, d_.scale, dgub, 2 * r, a, kTransposedBlock, out, d_.Hp);
      ops().gemm_nn(m, kTransposedBlock, r, d_.scale, dgub + r, 2 * r, a + r * kTransposedBlock,
                    kTransposedBlock, out, d_.Hp);
    }
  }
}

// 5. Tokens [kCombineTokens * item, ...): grad_in = the sum of each token's rows' dx (slot order,
// then pools), its slots' d weight.
void BackwardTask::combine(int64_t item) {
  const int64_t T = s_.tokens;
  for (int64_t t = item * kCombineTokens; t < std::min(T, (item + 1) * kCombineTokens); ++t) {
    float* gi = args_.grad_in + t * d_.H;
    std::fill(gi, gi + d_.H, 0.0f);
    for (int k = 0; k < d_.top_k; ++k) {
      const int64_t row = s_.slot_row[t * d_.top_k + k];
      args_.grad_weights[t * d_.top_k + k] = row < 0 ? 0.0f : ws_.dweight[row];
      if (row < 0) continue;
      for (int p = 0; p < d_.P; ++p)
        if (layer_.packed_slice(p).i_end > layer_.packed_slice(p).i_begin)
          table().add_weighted(gi, ws_.dx[p].data() + row * d_.Hp, 1.0f, d_.H);
    }
  }
}

}  // namespace kt::sft
