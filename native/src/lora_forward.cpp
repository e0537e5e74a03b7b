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

// The batch's routing, its input and the saved buffers for its rows.
void ForwardLora::routed(const ExpertRows& rows, int64_t tokens) {
  static_cast<ExpertRows&>(s_) = rows;
  s_.tokens = tokens, s_.top_k = d_.top_k;
  const int64_t R = s_.rows = rows.offsets[d_.E];
  const int r = d_.r;
  s_.x.resize(tokens * d_.H), s_.xa.assign(R * 2 * r, 0.0f), s_.g.resize(R * d_.Ip), s_.u.resize(R * d_.Ip);
  s_.h.resize(R * d_.Ip), s_.ha.assign(R * r, 0.0f);
  std::memcpy(s_.x.data(), hidden_, tokens * d_.H * 2);
}

// With adapters, one unit per active expert.
int64_t ForwardLora::gather_units() const {
  return lora_ ? static_cast<int64_t>(s_.active.size()) : 0;
}

// Active expert a: x A^T of gate and up for its rows.
void ForwardLora::gather_unit(int64_t a) {
  const int r = d_.r;
  const int e = s_.active[a];
  WorkerScratch& sc = worker_scratch();
  grow(sc.w0, 2 * r * d_.H), grow(sc.rows0, d_.H);
  load_f32(L_.weight[kGateA], L_.dtype, e * r * d_.H, r, d_.H, d_.H, false, sc.w0.data(), d_.H);
  load_f32(L_.weight[kUpA], L_.dtype, e * r * d_.H, r, d_.H, d_.H, false, sc.w0.data() + r * d_.H, d_.H);
  for (int64_t row = s_.offsets[e]; row < s_.offsets[e + 1]; ++row) {
    ops().bf16_row_to_float(hidden_ + s_.row_token[row] * d_.H, d_.H, sc.rows0.data());
    ops().gemm_nt(1, 2 * r, d_.H, 1.0f, sc.rows0.data(), d_.H, sc.w0.data(), d_.H, s_.xa.data() + row * 2 * r,
                  2 * r);
  }
}

// g, u += s xa B^T for each block (B's rows [i0, i0 + cols)); g and u kept.
void ForwardLora::gate_up_epilogue(int e, int64_t r0, int m, int64_t i0, int64_t blocks, int64_t width,
                                   float* c, int64_t ldc) {
  const int r = d_.r;
  const float* xa = s_.xa.data() + r0 * 2 * r;
  if (lora_)
    for (int64_t b = 0; b < blocks; ++b) {
      float* cg = c + b * 2 * width;  // the block's gate columns, then its up columns
      add_b_term(kGateB, e, d_.I, i0 + b * width, m, xa, 2 * r, width, cg, ldc);
      add_b_term(kUpB, e, d_.I, i0 + b * width, m, xa + r, 2 * r, width, cg + width, ldc);
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

// y += s ha B_down^T on one pool.
void ForwardLora::down_epilogue(int pool, int e, int64_t r0, int m, int64_t c0, int64_t n, float* c,
                                int64_t ldc) {
  if (lora_ && pool == d_.lora_pool)
    add_b_term(kDownB, e, d_.H, c0, m, s_.ha.data() + r0 * d_.r, d_.r, n, c, ldc);
}

// c[:, j] += s (a B[row0 + j]^T) for j in [0, n), B adapter `t` [E, rows, r] (zero past `rows`): B's
// rows transposed into fp32 scratch kBColumns at a time.
void ForwardLora::add_b_term(int t, int e, int64_t rows, int64_t row0, int m, const float* a, int64_t lda,
                             int64_t n, float* c, int64_t ldc) const {
  const int r = d_.r;
  WorkerScratch& sc = worker_scratch();
  grow(sc.w0, r * kBColumns);
  for (int64_t j0 = 0; j0 < n; j0 += kBColumns) {
    const int64_t cols = std::min(kBColumns, n - j0);
    std::fill(sc.w0.begin(), sc.w0.begin() + r * cols, 0.0f);
    load_f32(L_.weight[t], L_.dtype, (e * rows + row0 + j0) * r,
             std::clamp<int64_t>(rows - row0 - j0, 0, cols), r, r, true, sc.w0.data(), cols);
    ops().gemm_nn(m, cols, r, d_.scale, a, lda, sc.w0.data(), cols, c + j0, ldc);
  }
}

}  // namespace kt::sft
