// The fine-tuning tasks (kt/lora.h): the forward is the layer's forward plan (forward/forward.h)
// with the client below (lora_forward.cpp), the backward a step task of its own
// (lora_backward.cpp). Rows are the routed (token, expert) pairs grouped by expert (routing.h);
// the frozen products run the method's A16 GEMM (bf16 activations, every method and ISA has one)
// or, in the backward, its transposed form (kernels/transposed_gemm.h); the adapters' small
// products run the table's fp32 loops (kt/kernels.h, LoraKernels).
//
// Forward, with s = alpha / r, what the client adds to the plan's steps:
//   route:    x kept (per token)
//   gather:   per expert, xa = x [A_gate; A_up]^T
//   experts:  g, u = W x + s xa B^T, kept, and h = silu(g) u kept (per pool and run of blocks);
//             ha = h A_down^T once an expert's h is complete; y = W_down h (+ s ha B_down^T on
//             one pool) per row
//   combine:  out = sum over the token's rows of weight * y
// Backward from dY (dy = weight * dY per row), one step after another:
//   1. per expert: gather dY, dyb = dY B_down
//   2. per pool and 64 intermediate channels: dhu = dY W_down + s dyb A_down (the gradient to h
//      without the routing weight)
//   3. per expert: d weight = <dhu, h>; dh = weight dhu; dg, du through silu(g) u; the adapters'
//      gradients; dgb, dub = dg B_gate, du B_up
//   4. per pool and 64 hidden channels: dx = dg W_gate + du W_up (+ s (dgb A_gate + dub A_up) on one pool)
//   5. per token: grad_in = sum over its rows of dx; grad_weights per slot
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "forward/client.h"
#include "kt/aligned_vector.h"
#include "kt/kernels.h"
#include "kt/lora.h"
#include "kt/moe_layer.h"
#include "kt/runner.h"
#include "routing.h"
#include "work_items.h"

namespace kt {

// What one forward keeps for its backward: its routing (ExpertRows, the whole batch as one chunk)
// and per row the inputs of each product.
struct SftSaved : ExpertRows {
  int64_t tokens = 0, rows = 0;
  int top_k = 0;
  AlignedVector<uint16_t> x;      // [tokens, H] bf16, the input
  AlignedVector<float> xa;        // [rows, 2r]: x A_gate^T, then x A_up^T
  AlignedVector<float> g, u;      // [rows, Ip]
  AlignedVector<uint16_t> h;      // [rows, Ip] bf16
  AlignedVector<float> ha;        // [rows, r]
  const SftMoe* owner = nullptr;  // the layer whose forward filled it
};

// The backward's scratch, one task at a time (the runner runs them in order).
struct SftMoe::Scratch {
  std::vector<AlignedVector<float>> dx;  // per pool: [rows, Hp]
  AlignedVector<uint16_t> dy;            // [rows, H64] bf16 dY rows
  AlignedVector<float> dyb;              // [rows, r]
  AlignedVector<float> dhu;              // [rows, Ip]
  AlignedVector<float> dg, du;           // [rows, Ip]
  AlignedVector<uint16_t> dgu;           // [rows, 2 Ip] bf16, each pool's blocks as its gate/up panels
  AlignedVector<float> dgub;             // [rows, 2r]
  std::vector<float> dweight;            // [rows]
  std::atomic<bool> failed{false};
};

namespace sft {

constexpr int kMaxCallRows = 256;  // rows per backward GEMM call: bounds per-thread scratch

// The sizes every part reads.
struct Shape {
  int E, top_k, P, G, r;
  int64_t H, I, Hp, Ip, H16, width;
  float scale;    // alpha / r
  int lora_pool;  // the first pool with channels: it adds the adapters' terms of pool-split products
};
Shape shape_of(const MoeLayer& layer, const LoraConfig& lora);

// One worker's row pointers and fp32 buffers.
struct WorkerScratch {
  std::vector<const uint16_t*> ptrs;  // kMaxCallRows
  AlignedVector<float> c;             // a GEMM's output
  AlignedVector<float> w0, w1;        // adapter blocks in fp32
  AlignedVector<float> rows0, rows1;  // fp32 rows
  AlignedVector<float> grads;         // one expert's adapter gradients
};
WorkerScratch& worker_scratch();

// Adapter values [rows, cols] (row stride ld) of one dtype -> fp32 at dst (row stride ld_dst), or
// transposed: dst[c * ld_dst + r].
void load_f32(const void* src, DType dtype, int64_t offset, int64_t rows, int64_t cols, int64_t ld,
              bool transpose, float* dst, int64_t ld_dst);
// dst[offset + i] += src[i] for n values in the gradients' dtype; with `cols` > 0 src holds the
// [n / cols, cols] block transposed ([cols, n / cols]).
void add_into(void* dst, DType dtype, int64_t offset, const float* src, int64_t n, int64_t cols);

// The forward's client (lora_forward.cpp): the adapters' terms and what the backward reads, kept in
// `saved`.
class ForwardLora final : public ForwardClient {
 public:
  // `lora`: the adapters' terms are computed (a layer with adapters).
  ForwardLora(const MoeLayer& layer, const LoraTensors& tensors, bool lora, const Shape& d,
              const uint16_t* hidden, std::shared_ptr<SftSaved> saved);
  void routed(const ExpertRows& rows, int64_t tokens) override;  // x kept
  int64_t gather_units() const override;
  void gather_unit(int64_t unit) override;  // one active expert's xa
  void gate_up_epilogue(int e, int64_t r0, int m, int64_t i0, int64_t blocks, int64_t width, float* c,
                        int64_t ldc) override;
  void keep_h(int64_t r, int64_t i0, const uint16_t* h, int64_t n) override;
  void expert_h_done(int e) override;  // ha
  void down_epilogue(int pool, int e, int64_t r0, int m, int64_t c0, int64_t n, float* c,
                     int64_t ldc) override;

 private:
  // B's rows are transposed this many at a time: [r, 512] fp32 is 32 KiB at rank 16, and wider
  // slabs put B's r rows 8 KiB or more apart, in one L1 set (the transposing loads ran twice as long
  // at 2048).
  static constexpr int64_t kBColumns = 512;
  const LoraKernels& ops() const { return layer_.kernels().lora; }
  void add_b_term(int t, int e, int64_t rows, int64_t row0, int m, const float* a, int64_t lda, int64_t n,
                  float* c, int64_t ldc) const;

  const MoeLayer& layer_;
  const LoraTensors L_;
  const bool lora_;
  const Shape d_;
  const uint16_t* hidden_;  // bf16 [tokens, H]
  const std::shared_ptr<SftSaved> saved_;
  SftSaved& s_;
};

// The backward (lora_backward.cpp): its steps 1-5 (above), each opening when every unit of the one
// before has returned.
class BackwardTask final : public StepTask {
 public:
  // `lora`: the adapters' terms and gradients are computed (adapters, and not skip_lora).
  BackwardTask(const MoeLayer& layer, const LoraTensors& tensors, bool lora, const Shape& d,
               SftMoe::Scratch& ws, const SftBackwardArgs& args, std::shared_ptr<const SftSaved> saved);
  bool next_step(StepShape& shape) override;
  void run_unit(int64_t unit, const WorkerContext& ctx) override;

 private:
  enum class Step {
    kNone,
    kSize,
    kGatherGradOut,
    kDownTransposed,
    kExpertGrads,
    kGateUpTransposed,
    kCombine
  };
  const LoraKernels& ops() const { return layer_.kernels().lora; }
  const KernelTable& table() const { return layer_.kernels(); }

  void size_buffers();                              // one unit
  void gather_grad_out(int64_t a);                  // 1: active expert a
  void down_transposed(int pool, int64_t item);     // 2: (active expert, block of 64 channels)
  void expert_grads(int64_t a);                     // 3: active expert a
  void gate_up_transposed(int pool, int64_t item);  // 4: (active expert, block of 64 hidden channels)
  void combine(int64_t item);                       // 5: 8 tokens
  // Step 3's parts for rows [r0, r0 + m) of one expert: d weight, dg, du and their bf16 copy (h in
  // fp32 left in sc.rows0); the down adapters' gradients; gate's and up's (and dgb, dub).
  void gate_backward(int64_t r0, int64_t m, WorkerScratch& sc) const;
  void down_adapter_grads(int64_t r0, int64_t m, WorkerScratch& sc, float* g_da, float* g_db) const;
  void gate_up_adapter_grads(int64_t r0, int64_t m, WorkerScratch& sc, float* g_ga, float* g_gb, float* g_ua,
                             float* g_ub) const;

  const MoeLayer& layer_;
  const LoraTensors L_;
  const bool lora_;
  const Shape d_;
  SftMoe::Scratch& ws_;
  const SftBackwardArgs args_;
  const std::shared_ptr<const SftSaved> saved_;
  const SftSaved& s_;
  Step step_ = Step::kNone;
};

}  // namespace sft

}  // namespace kt
