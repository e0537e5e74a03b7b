// The fine-tuning tasks' steps (kt/lora.h): what lora.cpp's forward_task and backward_task call in
// order, with barriers between them; the forward's in lora_forward.cpp, the backward's in
// lora_backward.cpp. Rows are the routed (token, expert) pairs grouped by expert (routing.h); the
// frozen products run the method's A16 GEMM (bf16 activations, every method and ISA has one) or,
// in the backward, its transposed form (kernels/transposed_gemm.h); the adapters' small products
// run the table's fp32 loops (kt/kernels.h, LoraKernels).
//
// Forward, with s = alpha / r:
//   1. route (worker 0); per expert: gather x, xa = x [A_gate; A_up]^T
//   2. per pool and run of blocks of intermediate channels: g, u = W x + s xa B^T; h = silu(g) u
//   3. per expert: ha = h A_down^T
//   4. per pool and run of output panels: y = W_down h (+ s ha B_down^T on one pool)
//   5. per token: out = sum over its rows of weight * y
// Backward from dY (dy = weight * dY per row):
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
#include <vector>

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
  AlignedVector<uint16_t> x;      // [rows, Hp] bf16
  AlignedVector<float> xa;        // [rows, 2r]: x A_gate^T, then x A_up^T
  AlignedVector<float> g, u;      // [rows, Ip]
  AlignedVector<uint16_t> h;      // [rows, Ip] bf16
  AlignedVector<float> ha;        // [rows, r]
  const SftMoe* owner = nullptr;  // the layer whose forward filled it
};

namespace sft {

constexpr int kMaxCallRows = 256;  // rows per GEMM call: bounds per-thread scratch
constexpr int kMaxPhasePools = 64;
constexpr int kSteps = 5;
constexpr int64_t kDownRunPanels = 32;   // output panels of one down work item
constexpr int64_t kGateUpRunBlocks = 4;  // gate/up blocks of one work item

}  // namespace sft

// Scratch of one task at a time (the runner runs them in order).
struct SftMoe::Scratch {
  std::vector<AlignedVector<float>> y;  // per pool: [rows, H16] partial outputs, then [rows, Hp] dx
  AlignedVector<uint16_t> dy;           // [rows, H64] bf16 dY rows
  AlignedVector<float> dyb;             // [rows, r]
  AlignedVector<float> dhu;             // [rows, Ip]
  AlignedVector<float> dg, du;          // [rows, Ip]
  AlignedVector<uint16_t> dgu;          // [rows, 2 Ip] bf16, each pool's blocks as its gate/up panels
  AlignedVector<float> dgub;            // [rows, 2r]
  std::vector<float> dweight;           // [rows]
  PaddedCounter counters[sft::kSteps][sft::kMaxPhasePools];  // per step (and pool): its work items
  std::atomic<bool> failed{false};
};

namespace sft {

// The sizes every step reads.
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

// What every step of one task reads.
struct Pass {
  MoeLayer& layer;
  const LoraTensors& L;
  bool lora;  // adapter terms computed (a forward with adapters; a backward without skip_lora)
  Shape d;
  SftMoe::Scratch& ws;
  const KernelTable& table() const { return layer.kernels(); }
  const LoraKernels& ops() const { return layer.kernels().lora; }
  // Worker 0, before the task's first barrier: no failure yet, every step's items untaken.
  void start() const;
  // Runs one step's work on this worker unless a worker failed earlier in the task; a failure is
  // recorded for the runner's next sync, and every worker still reaches the barriers.
  template <class F>
  void step(F&& body) const {
    if (ws.failed.load(std::memory_order_acquire)) return;
    guarded(layer.runner(), ws.failed, body);
  }
  // Worker 0, sizing the task's buffers: the pools' y buffers hold `values` floats each.
  void size_pools(int64_t values) const;
};

struct ForwardSteps : Pass {
  const SftForwardArgs& args;
  SftSaved& s;
  void route() const;                                  // worker 0; the saved buffers sized
  void gather_inputs(const WorkerContext& ctx) const;  // 1
  void gate_up(const WorkerContext& ctx) const;        // 2
  void down_a(const WorkerContext& ctx) const;         // 3
  void down(const WorkerContext& ctx) const;           // 4
  void combine(const WorkerContext& ctx) const;        // 5
};

struct BackwardSteps : Pass {
  const SftBackwardArgs& args;
  const SftSaved& s;
  void size_buffers() const;                                // worker 0
  void gather_grad_out(const WorkerContext& ctx) const;     // 1
  void down_transposed(const WorkerContext& ctx) const;     // 2
  void expert_grads(const WorkerContext& ctx) const;        // 3
  void gate_up_transposed(const WorkerContext& ctx) const;  // 4
  void combine(const WorkerContext& ctx) const;             // 5

 private:
  // Step 3's parts for rows [r0, r0 + m) of one expert: d weight, dg, du and their bf16 copy (h in
  // fp32 left in sc.rows0); the down adapters' gradients; gate's and up's (and dgb, dub).
  void gate_backward(int64_t r0, int64_t m, WorkerScratch& sc) const;
  void down_adapter_grads(int64_t r0, int64_t m, WorkerScratch& sc, float* g_da, float* g_db) const;
  void gate_up_adapter_grads(int64_t r0, int64_t m, WorkerScratch& sc, float* g_ga, float* g_gb, float* g_ua,
                             float* g_ub) const;
};

}  // namespace sft

}  // namespace kt
