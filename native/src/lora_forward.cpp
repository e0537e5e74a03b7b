// The fine-tuning forward's client of the forward plan (lora_tasks.h): the adapters' terms and what
// the backward reads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include "lora_tasks.h"

namespace kt::sft {

ForwardLora::ForwardLora(const MoeLayer& layer, const LoraTensors& tensors, bool lora, const Shape& d,
                         const uint16_t* hidden, std::shared_ptr<SftSaved> saved)
    : layer_(layer),
      L_(tensors),
      lora_(lora),
      d_(d),
      hidden_(hidden),
      saved_(std::move(saved)),
      s_(*saved_) {}

// The batch's routing and the saved buffers for its rows.
void ForwardLora::routed(const ExpertRows& rows, int64_t tokens) {
  static_cast<ExpertRows&>(s_) = rows;
  s_.tokens = tokens, s_.top_k = d_.top_k;
  const int64_t R = s_.rows = rows.offsets[d_.E];
  const int r = d_.r;
  s_.x.resize(R * d_.Hp), s_.xa.assign(R * 2 * r, 0.0f), s_.g.resize(R * d_.Ip), s_.u.resize(R * d_.Ip);
  s_.h.resize(R * d_.Ip), s_.ha.assign(R * r, 0.0f);
}

int64_t ForwardLora::gather_units() const {
  return static_cast<int64_t>(s_.active.size());
}

// Active expert a: its rows of x, and x A^T of gate and up.
void ForwardLora::gather_unit(int64_t a) {
  const int r = d_.r;
  const int e = s_.active[a];
  const int64_t r0 = s_.offsets[e], n = s_.offsets[e + 1] - r0;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t* row = s_.x.data() + (r0 + i) * d_.Hp;
    std::memcpy(row, hidden_ + s_.row_token[r0 + i] * d_.H, d_.H * 2);
    std::fill(row + d_.H, row + d_.Hp, uint16_t{0});
  }
  if (!lora_) return;
  WorkerScratch& sc = worker_scratch();
  grow(sc.w0, 2 * r * d_.H), grow(sc.rows0, d_.H);
  load_f32(L_.weight[kGateA], L_.dtype, e * r * d_.H, r, d_.H, d_.H, false, sc.w0.data(), d_.H);
  load_f32(L_.weight[kUpA], L_.dtype, e * r * d_.H, r, d_.H, d_.H, false, sc.w0.data() + r * d_.H, d_.H);
  for (int64_t i = 0; i < n; ++i) {
    ops().bf16_row_to_float(s_.x.data() + (r0 + i) * d_.Hp, d_.H, sc.rows0.data());
    ops().gemm_nt(1, 2 * r, d_.H, 1.0f, sc.rows0.data(), d_.H, sc.w0.data(), d_.H,
                  s_.xa.data() + (r0 + i) * 2 * r, 2 * r);
  }
}

// g, u += s xa B^T for each block (B's rows [i0, i0 + cols) transposed, zero past I); g and u kept.
void ForwardLora::gate_up_epilogue(int e, int64_t r0, int m, int64_t i0, int64_t blocks, int64_t width,
                                   float* c, int64_t ldc) {
  const int r = d_.r;
  const int64_t cols = blocks * width;
  if (lora_) {
    WorkerScratch& sc = worker_scratch();
    grow(sc.w0, 2 * r * cols);
    float* bt_gate = sc.w0.data();  // [r, cols]
    float* bt_up = sc.w0.data() + r * cols;
    const int64_t lora_rows = std::clamp<int64_t>(d_.I - i0, 0, cols);
    std::fill(sc.w0.begin(), sc.w0.begin() + 2 * r * cols, 0.0f);
    load_f32(L_.weight[kGateB], L_.dtype, (e * d_.I + i0) * r, lora_rows, r, r, true, bt_gate, cols);
    load_f32(L_.weight[kUpB], L_.dtype, (e * d_.I + i0) * r, lora_rows, r, r, true, bt_up, cols);
    const float* xa = s_.xa.data() + r0 * 2 * r;
    for (int64_t b = 0; b < blocks; ++b) {
      float* cg = c + b * 2 * width;  // the block's gate columns, then its up columns
      ops().gemm_nn(m, width, r, d_.scale, xa, 2 * r, bt_gate + b * width, cols, cg, ldc);
      ops().gemm_nn(m, width, r, d_.scale, xa + r, 2 * r, bt_up + b * width, cols, cg + width, ldc);
    }
  }
  for (int i = 0; i < m; ++i)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = (r0 + i) * d_.Ip + i0 + b * width;
      std::memcpy(s_.g.data() + at, c + i * ldc + b * 2 * width, width * 4);
      std::memcpy(s_.u.data() + at, c + i * ldc + b * 2 * width + width, width * 4);
    }
}

void ForwardLora::keep_h(int64_t r, int64_t i0, const uint16_t* h, int64_t n) {
  std::memcpy(s_.h.data() + r * d_.Ip + i0, h, n * 2);
}

// ha = h A_down^T for expert e's rows.
void ForwardLora::expert_h_done(int e) {
  if (!lora_) return;
  const int r = d_.r;
  WorkerScratch& sc = worker_scratch();
  grow(sc.w0, r * d_.I), grow(sc.rows0, d_.I);
  load_f32(L_.weight[kDownA], L_.dtype, e * r * d_.I, r, d_.I, d_.I, false, sc.w0.data(), d_.I);
  for (int64_t row = s_.offsets[e]; row < s_.offsets[e + 1]; ++row) {
    ops().bf16_row_to_float(s_.h.data() + row * d_.Ip, d_.I, sc.rows0.data());
    ops().gemm_nt(1, r, d_.I, 1.0f, sc.rows0.data(), d_.I, sc.w0.data(), d_.I, s_.ha.data() + row * r, r);
  }
}

// y += s ha B_down^T on one pool (B_down's rows [c0, c0 + n) transposed, zero past H).
void ForwardLora::down_epilogue(int pool, int e, int64_t r0, int m, int64_t c0, int64_t n, float* c,
                                int64_t ldc) {
  if (!lora_ || pool != d_.lora_pool) return;
  const int r = d_.r;
  WorkerScratch& sc = worker_scratch();
  grow(sc.w0, r * n);
  std::fill(sc.w0.begin(), sc.w0.begin() + r * n, 0.0f);
  load_f32(L_.weight[kDownB], L_.dtype, (e * d_.H + c0) * r, std::clamp<int64_t>(d_.H - c0, 0, n), r, r, true,
           sc.w0.data(), n);
  ops().gemm_nn(m, n, r, d_.scale, s_.ha.data() + r0 * r, r, sc.w0.data(), n, c, ldc);
}

}  // namespace kt::sft
