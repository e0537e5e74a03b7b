// The forward task of MoeLayer: its steps and their units, in the order they run per chunk of tokens.
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/activations.h"
#include "kt/aligned_vector.h"
#include "kt/moe_layer.h"
#include "kt/thread_scratch.h"
#include "moe_layer_state.h"
#include "routing.h"
#include "work_items.h"

namespace kt {

namespace {

constexpr int kRowChunk = 512;      // rows per kernel call: bounds per-thread scratch
constexpr int kMinDownPanels = 4;   // output channels per down work item: at least 4 x 16 ...
constexpr int kMaxDownPanels = 32;  // ... at most 32 x 16; each item reads every expert's h once
// Work items are made as long as the pool's balance allows: each is a contiguous run of weights,
// and longer runs stream faster (Zen 4, Qwen3 at T=1 in the host's fast state: gate/up items of 4
// blocks and down items of two per worker, x1.05-1.11 against 1 block and four per worker; 6
// blocks, the most 8 items per worker leave there, another x1.03; with an item's blocks in one
// kernel call, 12 blocks (a whole expert, 4 items per worker) another x1.04).
constexpr int kMaxGateUpBlocks = 16;         // blocks of intermediate channels per gate/up item ...
constexpr int kMinGateUpItemsPerWorker = 4;  // ... while each worker still gets at least 4 items
constexpr int kDownItemsPerWorker = 2;
// Chunks of at most this many tokens keep each row's down projection apart (phase 3), so that down
// items can be long runs of one expert's weights, at most kMaxRunPanels x 16 channels.
constexpr int64_t kMaxDownRowsTokens = 32;
constexpr int64_t kMaxRunPanels = 128;

// Rows per kernel call for an expert with `rows` rows: at most kRowChunk, split evenly in whole
// blocks. Each call streams (A16: dequantizes) all of the expert's weights, so a split of 256 + a
// few rows paid that twice for a few rows (DeepSeek at 2048 tokens: half the experts).
int64_t rows_per_call(int64_t rows) {
  const int64_t calls = (rows + kRowChunk - 1) / kRowChunk;
  return std::min<int64_t>(kRowChunk, round_up((rows + calls - 1) / calls, kRowBlock));
}

// Address of row `r` (a padded row index) in a tiled buffer whose rows hold `row_bytes`.
uint8_t* tiled_row(uint8_t* base, int64_t r, int64_t row_bytes) {
  return base + (r / kRowBlock) * kRowBlock * row_bytes + (r % kRowBlock) * kChunkBytes;
}

// Writes `n` bytes at byte offset `offset` of a tiled row; both are whole 64-byte chunks (rows are
// padded to 64 K-values, h blocks are groups). Copies of a constant 64 bytes: with a length known
// only at run time, GCC inlined an 8-byte loop that took 7% of a BF16 prefill.
void store_tiled(uint8_t* row, int64_t offset, const void* src, int64_t n) {
  const auto* s = static_cast<const uint8_t*>(src);
  uint8_t* dst = row + offset / kChunkBytes * kTiledChunkStride;
  for (int64_t c = 0; c < n / kChunkBytes; ++c)
    std::memcpy(dst + c * kTiledChunkStride, s + c * kChunkBytes, kChunkBytes);
}

}  // namespace

// One chunk of a forward task: its tokens, the layer's sizes and what the method's kernels read.
struct MoeLayer::Chunk {
  const ForwardArgs& args;
  int64_t c0 = 0, Tc = 0;  // tokens [c0, c0 + Tc) of the batch
  int E, K, P, G, Gd;      // experts, top-k, pools, quantization groups of gate/up and down
  int64_t H, Hp, Hy, Gh;   // hidden size, padded to the group and to 16; intermediate block
  // Gate/up read int8 inputs quantized per (token, group) (else bf16), the down projection an int8
  // h quantized per (row, group) or per row (ws.h_per_row; else bf16): MethodTraits::gate_up_input
  // / down_input. The bf16-input kernel also runs gate/up of the experts with many rows (ws.a16)
  // where it is faster.
  bool int8_x, int8_h;
  GemmQ8Fn gemm_q, down_q;  // gate/up's kernels, down's
  GemmA16Fn gemm_a16, down_a16;
};

namespace {

// Row r of expert e sits at padded row r + padding_before(ws, e) of the gathered buffers.
int64_t padding_before(const MoeWorkspace& ws, int e) {
  return ws.padded_offsets[e] - ws.offsets[e];
}

// A worker's row pointers for one kernel call, and the call's output.
struct KernelScratch {
  std::vector<const void*> ptr_a, ptr_s, ptr_m;
  AlignedVector<float> c_buf;  // AMX stores full row blocks here directly
  std::vector<uint16_t> h_bf16;
  Bf16Rows bf16_rows() const {
    return {reinterpret_cast<const uint16_t* const*>(ptr_a.data()), kTiledChunkStride};
  }
};

KernelScratch& kernel_scratch() {
  auto& sc = *thread_scratch<KernelScratch>();
  grow(sc.ptr_a, kRowChunk), grow(sc.ptr_s, kRowChunk), grow(sc.ptr_m, kRowChunk);
  return sc;
}

// Points sc.ptr_a at rows [r0, r0 + m) of expert e in a tiled buffer.
void point_rows(KernelScratch& sc, const MoeWorkspace& ws, int e, int64_t r0, int m, const uint8_t* rows_base,
                int64_t row_bytes) {
  for (int i = 0; i < m; ++i)
    sc.ptr_a[i] = tiled_row(const_cast<uint8_t*>(rows_base), r0 + i + padding_before(ws, e), row_bytes);
}

// Row r of expert e's h (a pool's `slice` of it), quantized to int8 for the down projection
// (int8_h methods): per group, or with one scale for the row (ws.h_per_row).
void quantize_h_row(const MoeWorkspace& ws, MoeWorkspace::PoolScratch& ps, int64_t slice, int G, int e,
                    int64_t r) {
  thread_local std::vector<float> row;
  thread_local AlignedVector<uint8_t> q;
  grow(row, slice), grow(q, slice);
  const int64_t pr = r + padding_before(ws, e);
  const uint16_t* h_row[1] = {reinterpret_cast<const uint16_t*>(tiled_row(ps.h_rows.data(), pr, slice * 2))};
  const Bf16Rows h{h_row, kTiledChunkStride};
  for (int64_t k0 = 0; k0 < slice; k0 += kChunkBytes / 2) {  // a chunk's values at a time: vectorized
    const uint16_t* chunk = kernels::bf16_at(h, 0, k0);
    for (int64_t j = 0; j < kChunkBytes / 2; ++j) row[k0 + j] = bf16_to_float(chunk[j]);
  }
  quantize_activation_row(row.data(), slice, G, ws.h_per_row[e], reinterpret_cast<int8_t*>(q.data()),
                          ps.h_scale.data() + pr * (slice / G), ps.h_sum.data() + pr * (slice / G));
  store_tiled(tiled_row(ps.h_q.data(), pr, slice), 0, q.data(), slice);
}

// Waits until `count` reaches `target` (units of the same step that other workers hold), or throws
// once a worker failed.
void wait_until(const std::atomic<int64_t>& count, int64_t target, const std::atomic<bool>& failed) {
  for (int i = 0; count.load(std::memory_order_acquire) < target; ++i) {
    if (failed.load(std::memory_order_acquire))
      throw std::runtime_error("forward: stopped after another worker failed");
    if (i < 4096)
      _mm_pause();
    else
      sched_yield();
  }
}

// Rows of the longest kernel call: a token may name an expert twice, so up to Tc * top_k.
int64_t max_rows_per_call(const MoeWorkspace& ws) {
  int64_t max_rows = 0;
  for (int e : ws.active) max_rows = std::max(max_rows, rows_per_call(ws.counts[e]));
  return max_rows;
}

}  // namespace

// How the open chunk's steps are cut into units: set when the chunk is routed.
struct MoeLayer::Plan {
  int64_t max_rows = 0;                          // rows of the longest kernel call
  int64_t tokens_per_unit = 1, token_units = 0;  // gather, combine: runs of tokens, four per worker
  struct Pool {
    int64_t per_item = 1, items_per_expert = 0, blocks_per_call = 1, gate_up_items = 0;  // gate/up
    int64_t experts_units = 0;         // the experts step: gate/up items, [int8 h blocks,] down units
    int64_t quantize_h_units = 0;      // large chunks of int8_h methods: one per block of 32 rows
    std::vector<int64_t> down_starts;  // small chunks: each down range's first (expert, panel), then the end
    int64_t down_per_item = 0, down_units = 0;  // large chunks: output panels per item; either: units
  };
  std::vector<Pool> pools;
  int64_t splits = 1, width = 0, combine_units = 0;  // combine: column splits per token, their width
};

// The forward as steps, per chunk of tokens: route (the first with the start checks), gather, the
// experts (gate/up, the int8 h of large chunks, down; per pool), combine. Each opens when every
// unit of the one before has returned.
class MoeLayer::ForwardTask final : public StepTask {
 public:
  ForwardTask(MoeLayer& layer, const ForwardArgs& args)
      : layer_(layer),
        args_(args),
        chunk_{args_,
               0,
               0,
               layer.config_.num_experts,
               layer.config_.top_k,
               static_cast<int>(layer.pools_.size()),
               layer.group_,
               layer.config_.down_group,
               layer.config_.hidden,
               layer.hidden_padded_,
               round_up(layer.config_.hidden, kPanelWidth),
               layer.h_group(),
               method_traits(layer.config_.method).gate_up_input == Activation::kInt8,
               method_traits(*layer.config_.down_method).down_input == Activation::kInt8,
               layer.table_.method(layer.config_.method).gemm_q8,
               layer.table_.method(*layer.config_.down_method).gemm_q8,
               layer.table_.method(layer.config_.method).gemm_a16,
               layer.table_.method(*layer.config_.down_method).gemm_a16} {
    plan_.pools.resize(layer.pools_.size());
  }

  bool next_step(StepShape& shape) override {
    if (advance(shape)) return true;
    // The stream waiting on this word reads the output next (the task's end, failed or not).
    if (args_.done_flag) std::atomic_ref<uint32_t>(*args_.done_flag).store(1, std::memory_order_release);
    return false;
  }

  void run_unit(int64_t unit, const WorkerContext& ctx) override {
    switch (step_) {
      case Step::kStart:
        started_ = layer_.start(chunk_);
        break;
      case Step::kRoute:
        layer_.route(chunk_);
        break;
      case Step::kGather: {
        const int64_t t0 = unit * plan_.tokens_per_unit;
        layer_.gather_tokens(chunk_, t0, std::min(chunk_.Tc, t0 + plan_.tokens_per_unit));
        break;
      }
      case Step::kExperts:
        run_experts_unit(unit, ctx);
        break;
      case Step::kCombine:
        layer_.combine_item(chunk_, plan_, unit);
        break;
      case Step::kNone:
        break;
    }
  }

 private:
  enum class Step { kNone, kStart, kRoute, kGather, kExperts, kCombine };

  // The next step's shape; false when the task is done.
  bool advance(StepShape& shape) {
    MoeWorkspace& ws = *layer_.workspace_;
    auto any = [&](int64_t units) {
      shape.kind = StepShape::Kind::kAnyWorker;
      shape.units = units;
      return true;
    };
    auto per_pool = [&](int64_t Plan::Pool::* units) {
      shape.kind = StepShape::Kind::kPerPool;
      for (int p = 0; p < chunk_.P; ++p) shape.pool_units[p] = plan_.pools[p].*units;
      return true;
    };
    if (step_ == Step::kNone) {
      step_ = Step::kStart;
      return any(1);
    }
    if (step_ == Step::kStart && !started_) return false;
    if (step_ == Step::kStart || step_ == Step::kRoute) {
      if (ws.bad_routing) return false;
      layer_.plan_steps(chunk_, plan_);
      step_ = Step::kGather;
      return any(plan_.token_units);
    }
    if (ws.failed.load(std::memory_order_acquire)) return false;
    switch (step_) {
      case Step::kGather:
        step_ = Step::kExperts;
        return per_pool(&Plan::Pool::experts_units);
      case Step::kCombine:  // the next chunk
        chunk_.c0 += layer_.config_.max_chunk_tokens;
        if (chunk_.c0 >= ws.tokens) return false;
        chunk_.Tc = std::min(layer_.config_.max_chunk_tokens, ws.tokens - chunk_.c0);
        step_ = Step::kRoute;
        return any(1);
      default:
        break;
    }
    step_ = Step::kCombine;
    return any(plan_.combine_units);
  }

  // A pool's units of the experts step, taken in order: its gate/up items, then (large chunks of
  // int8_h methods) its int8 h blocks, then its down units. Each waits only for what it reads, in
  // its own pool: large chunks' h blocks for every gate/up item, their down units for every h
  // block (or gate/up item); small chunks' down runs for their expert's h (down_unit). Every unit
  // waited for was taken before the waiting one, so the waits end; the pools go on independently.
  void run_experts_unit(int64_t unit, const WorkerContext& ctx) {
    MoeWorkspace& ws = *layer_.workspace_;
    const Plan::Pool& pp = plan_.pools[ctx.pool];
    auto& ps = ws.pools[ctx.pool];
    if (unit < pp.gate_up_items) {
      layer_.gate_up_item(chunk_, plan_, ctx, unit);
      ps.stage_done[0].fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    unit -= pp.gate_up_items;
    if (!ws.down_rows && unit < pp.quantize_h_units) {
      wait_until(ps.stage_done[0], pp.gate_up_items, ws.failed);
      layer_.quantize_h_unit(chunk_, ctx, unit);
      ps.stage_done[1].fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    if (!ws.down_rows) {
      unit -= pp.quantize_h_units;
      if (pp.quantize_h_units > 0)
        wait_until(ps.stage_done[1], pp.quantize_h_units, ws.failed);
      else
        wait_until(ps.stage_done[0], pp.gate_up_items, ws.failed);
    }
    layer_.down_unit(chunk_, plan_, ctx, unit);
  }

  MoeLayer& layer_;
  const ForwardArgs args_;
  Chunk chunk_;
  Plan plan_;
  Step step_ = Step::kNone;
  bool started_ = false;
};

std::shared_ptr<StepTask> MoeLayer::forward_task(const ForwardArgs& args) {
  return std::make_shared<ForwardTask>(*this, args);
}

// Reads the batch size (at run time when args.tokens_ptr is set) and routes the first chunk.
bool MoeLayer::start(Chunk& chunk) {
  MoeWorkspace& ws = *workspace_;
  const ForwardArgs& args = chunk.args;
  ws.tokens = args.tokens_ptr ? *args.tokens_ptr : args.tokens;
  grow(ws.pools, static_cast<size_t>(chunk.P));
  if (ws.tokens < 0 || (args.max_tokens > 0 && ws.tokens > args.max_tokens)) {
    const std::string bound =
        args.max_tokens > 0 ? "outside [0, " + std::to_string(args.max_tokens) + "] (the buffers' capacity)"
                            : "negative";
    throw std::invalid_argument("forward: the batch size read at run time is " + std::to_string(ws.tokens) +
                                ", " + bound);
  }
  if (ws.tokens == 0) return false;
  chunk.Tc = std::min(config_.max_chunk_tokens, ws.tokens);
  route(chunk);
  return true;
}

// The units of the routed chunk's steps: as long as each pool's balance allows.
void MoeLayer::plan_steps(const Chunk& chunk, Plan& plan) const {
  const MoeWorkspace& ws = *workspace_;
  const int64_t active = static_cast<int64_t>(ws.active.size());
  const int threads = runner_->num_threads();
  plan.max_rows = max_rows_per_call(ws);
  plan.tokens_per_unit = std::max<int64_t>(1, chunk.Tc / (4 * threads));
  plan.token_units = (chunk.Tc + plan.tokens_per_unit - 1) / plan.tokens_per_unit;
  const int64_t panels = chunk.Hy / kPanelWidth;
  for (int p = 0; p < chunk.P; ++p) {
    Plan::Pool& pp = plan.pools[p];
    const int64_t pool_size = static_cast<int64_t>(runner_->pool(p).cpus.size());
    const int64_t slice = pools_[p]->i_end - pools_[p]->i_begin;
    const int64_t slice_groups = slice / chunk.Gh;
    pp.per_item = std::clamp<int64_t>(active * slice_groups / (kMinGateUpItemsPerWorker * pool_size), 1,
                                      kMaxGateUpBlocks);
    pp.items_per_expert = (slice_groups + pp.per_item - 1) / pp.per_item;
    // Small chunks run an item's blocks in one kernel call, one uninterrupted pass over its
    // weights (Zen 4, Qwen3 INT4 at T=1: x1.03-1.04 when the host's bandwidth is high); large
    // ones one block per call, so that c_buf stays within the L2.
    pp.blocks_per_call = ws.down_rows ? pp.per_item : 1;
    pp.gate_up_items = pp.items_per_expert * active;
    pp.quantize_h_units = chunk.int8_h && slice > 0 ? (ws.offsets[chunk.E] + kRowBlock - 1) / kRowBlock : 0;
    pp.down_starts.clear();
    pp.down_units = 0;
    pp.experts_units = pp.gate_up_items;
    if (slice == 0) continue;
    if (ws.down_rows) {
      // Runs of (expert, panel) pairs: long ones first, shorter as the work runs out, so that the
      // workers finish together.
      const int64_t units = active * panels, max_panels = std::min<int64_t>(kMaxRunPanels, panels);
      for (int64_t u = 0; u < units;) {
        pp.down_starts.push_back(u);
        u += std::clamp<int64_t>(
            std::min(max_panels,
                     std::max<int64_t>(kMinDownPanels, (units - u) / (kDownItemsPerWorker * pool_size))),
            1, units - u);
      }
      pp.down_starts.push_back(units);
      pp.down_units = static_cast<int64_t>(pp.down_starts.size()) - 1;
    } else {
      // Few, wide items (h is re-read per item, and each expert's run of weights is longer).
      pp.down_per_item =
          std::clamp<int64_t>(panels / (kDownItemsPerWorker * pool_size), kMinDownPanels, kMaxDownPanels);
      pp.down_units = (panels + pp.down_per_item - 1) / pp.down_per_item;
    }
    pp.experts_units = pp.gate_up_items + (ws.down_rows ? 0 : pp.quantize_h_units) + pp.down_units;
  }
  // With fewer tokens than workers (decode) each token's columns are split among them.
  plan.splits = std::max<int64_t>(1, threads / chunk.Tc);
  plan.width = round_up((chunk.H + plan.splits - 1) / plan.splits, kPanelWidth);
  plan.combine_units = plan.token_units * plan.splits;
}

// Routing: groups chunk [c0, c0 + Tc)'s rows by expert and sizes the buffers; sets
// ws.bad_routing on failure.
void MoeLayer::route(const Chunk& chunk) {
  MoeWorkspace& ws = *workspace_;
  const auto& [args, c0, Tc, E, K, P, G, Gd, H, Hp, Hy, Gh, int8_x, int8_h, gemm_q, down_q, gemm_a16,
               down_a16] = chunk;
  const int64_t elem = int8_x ? 1 : 2;  // bytes per gathered activation value
  const int a16_min_rows = table_.method(config_.method).gate_up_a16_min_rows;
  const int h_per_row_min_rows = table_.method(*config_.down_method).down_h_per_row_min_rows;
  ws.bad_routing = true;  // until routing succeeds
  ws.failed.store(false, std::memory_order_relaxed);
  guarded(*runner_, ws.failed, [&] {
    if (args.tokens_ptr) {  // read at run time: submit could not check them
      const size_t bytes = args.ids_int64 ? sizeof(int64_t) : sizeof(int32_t);
      check_expert_ids(static_cast<const uint8_t*>(args.expert_ids) + c0 * K * bytes, args.ids_int64, Tc, K,
                       E, c0);
    }
    route_rows({args.expert_ids, args.ids_int64, args.weights, args.skip_mask}, c0, Tc, K, E, storage_.data(),
               ws);
    ws.padded_offsets.assign(E + 1, 0);
    ws.a16.assign(E, 0);
    ws.h_per_row.assign(E, 0);
    bool any_a16 = false;
    for (int e = 0; e < E; ++e) {
      ws.padded_offsets[e + 1] = ws.padded_offsets[e] + round_up(ws.counts[e], kRowBlock);
      ws.a16[e] = int8_x && a16_min_rows > 0 && ws.counts[e] >= a16_min_rows;
      any_a16 = any_a16 || ws.a16[e];
      ws.h_per_row[e] = int8_h && h_per_row_min_rows > 0 && ws.counts[e] >= h_per_row_min_rows;
    }
    const int64_t R = ws.offsets[E], Rp = ws.padded_offsets[E];
    if (int8_x) grow(ws.x_q, Tc * Hp), grow(ws.x_scale, Tc * Hp / G), grow(ws.x_sum, Tc * Hp / G);
    ws.down_rows = Tc <= kMaxDownRowsTokens;
    grow(ws.x_rows, Rp * Hp * elem);
    if (any_a16) grow(ws.x_rows16, Rp * Hp * 2);
    for (int p = 0; p < P; ++p) {
      auto& ps = ws.pools[p];
      const int64_t slice = pools_[p]->i_end - pools_[p]->i_begin;
      grow(ps.h_rows, Rp * slice * 2);
      if (int8_h)
        grow(ps.h_q, Rp * slice), grow(ps.h_scale, Rp * slice / Gd), grow(ps.h_sum, Rp * slice / Gd);
      grow(ps.y, (ws.down_rows ? R : Tc) * Hy);
      if (ps.ready_size < ws.active.size()) {
        ps.ready = std::make_unique<std::atomic<int64_t>[]>(ws.active.size());
        ps.ready_size = ws.active.size();
      }
      for (size_t a = 0; a < ws.active.size(); ++a) ps.ready[a].store(0, std::memory_order_relaxed);
      for (int stage = 0; stage < 2; ++stage) ps.stage_done[stage].store(0, std::memory_order_relaxed);
    }
    ws.bad_routing = false;
  });
}

// Gather/quantize tokens [t0, t1) of the chunk: each token's input quantized once for all its
// experts (int8_x), then gathered into each of its rows in the tiled layout; its partial sums
// cleared.
void MoeLayer::gather_tokens(const Chunk& chunk, int64_t t0, int64_t t1) {
  MoeWorkspace& ws = *workspace_;
  const auto& [args, c0, Tc, E, K, P, G, Gd, H, Hp, Hy, Gh, int8_x, int8_h, gemm_q, down_q, gemm_a16,
               down_a16] = chunk;
  guarded(*runner_, ws.failed, [&] {
    thread_local std::vector<float> row;
    thread_local std::vector<uint16_t> padded;
    grow(row, Hp), grow(padded, Hp);
    const int64_t H_whole = H / (kChunkBytes / 2) * (kChunkBytes / 2);  // bf16 values in whole chunks
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* x = args.hidden + (c0 + t) * H;
      if (int8_x) {
        for (int64_t i = 0; i < H; ++i) row[i] = bf16_to_float(x[i]);
        std::fill(row.begin() + H, row.begin() + Hp, 0.0f);
        quantize_activation_row(row.data(), Hp, G, method_traits(config_.method).gate_up_input_per_row,
                                ws.x_q.data() + t * Hp, ws.x_scale.data() + t * (Hp / G),
                                ws.x_sum.data() + t * (Hp / G));
      }
      if (!ws.down_rows)
        for (int p = 0; p < P; ++p) std::fill_n(ws.pools[p].y.data() + t * Hy, Hy, 0.0f);
      for (int j = 0; j < K; ++j) {
        const int64_t r = ws.slot_row[t * K + j];
        if (r < 0) continue;
        const int e = ws.row_expert[r];
        if (int8_x && !ws.a16[e]) {
          store_tiled(tiled_row(ws.x_rows.data(), r + padding_before(ws, e), Hp), 0, ws.x_q.data() + t * Hp,
                      Hp);
          continue;
        }
        // Whole chunks straight from the input; the last, zero-padded ones through `padded`.
        uint8_t* dst =
            tiled_row(int8_x ? ws.x_rows16.data() : ws.x_rows.data(), r + padding_before(ws, e), Hp * 2);
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

// Gate/up and h (per pool): h = silu(x Wg^T) * (x Wu^T), stored in bf16, for one expert and a run of
// blocks of intermediate channels (the unit gate and up are interleaved by): item `item` of the
// pool's plan. In small chunks the worker that completes an expert's h also quantizes it (int8_h)
// and marks it ready for down.
void MoeLayer::gate_up_item(const Chunk& chunk, const Plan& plan, const WorkerContext& ctx, int64_t item) {
  MoeWorkspace& ws = *workspace_;
  const auto& [args, c0, Tc, E, K, P, G, Gd, H, Hp, Hy, Gh, int8_x, int8_h, gemm_q, down_q, gemm_a16,
               down_a16] = chunk;
  const PoolWeights& pw = *pools_[ctx.pool];
  auto& ps = ws.pools[ctx.pool];
  const int64_t slice = pw.i_end - pw.i_begin;
  const int64_t slice_groups = slice / Gh;
  const Plan::Pool& pp = plan.pools[ctx.pool];
  KernelScratch& sc = kernel_scratch();
  guarded(*runner_, ws.failed, [&] {
    const int npan = static_cast<int>(Gh / kPanelWidth);
    grow(sc.h_bf16, Gh);
    const int64_t block_bytes = 2 * npan * panel_bytes(config_.method, G, Hp);
    const int64_t per_item = pp.per_item, blocks_per_call = pp.blocks_per_call;
    grow(sc.c_buf, plan.max_rows * blocks_per_call * 2 * Gh);
    const GluConfig& glu = config_.glu;
    const bool general_glu = !glu.plain() || !gate_bias_.empty() || !up_bias_.empty();
    // Blocks [gl0, gl0 + nb) of expert ws.active[a]: its intermediate channels [gl0 * Gh,
    // (gl0 + nb) * Gh) of the slice.
    auto gate_up_blocks = [&](int64_t a, int64_t gl0, int64_t nb) {
      const int e = ws.active[a];
      const uint8_t* w = pw.gate_up + storage_[e] * pw.gate_up_bytes + gl0 * block_bytes;
      const int64_t ldc = 2 * Gh * nb;
      const int panels = static_cast<int>(2 * npan * nb);
      const int64_t step = rows_per_call(ws.counts[e]);
      for (int64_t r0 = ws.offsets[e]; r0 < ws.offsets[e + 1]; r0 += step) {
        const int m = static_cast<int>(std::min<int64_t>(step, ws.offsets[e + 1] - r0));
        if (ws.a16[e]) {
          point_rows(sc, ws, e, r0, m, ws.x_rows16.data(), Hp * 2);
          gemm_a16(m, Hp, G, sc.bf16_rows(), w, panels, sc.c_buf.data(), ldc);
        } else if (int8_x) {
          point_rows(sc, ws, e, r0, m, ws.x_rows.data(), Hp);
          for (int i = 0; i < m; ++i) {
            const int64_t t = ws.row_token[r0 + i];
            sc.ptr_s[i] = ws.x_scale.data() + t * (Hp / G), sc.ptr_m[i] = ws.x_sum.data() + t * (Hp / G);
          }
          const QuantRows a{reinterpret_cast<const int8_t* const*>(sc.ptr_a.data()), kTiledChunkStride,
                            reinterpret_cast<const float* const*>(sc.ptr_s.data()),
                            reinterpret_cast<const float* const*>(sc.ptr_m.data())};
          gemm_q(m, Hp, G, a, w, panels, sc.c_buf.data(), ldc);
        } else {
          point_rows(sc, ws, e, r0, m, ws.x_rows.data(), Hp * 2);
          gemm_a16(m, Hp, G, sc.bf16_rows(), w, panels, sc.c_buf.data(), ldc);
        }
        for (int i = 0; i < m; ++i) {
          uint8_t* h_row = tiled_row(ps.h_rows.data(), r0 + i + padding_before(ws, e), slice * 2);
          for (int64_t b = 0; b < nb; ++b) {
            const float* cg = sc.c_buf.data() + i * ldc + b * 2 * Gh;
            if (general_glu) {
              const int64_t at = e * intermediate_padded_ + pw.i_begin + (gl0 + b) * Gh;
              glu_general(cg, cg + Gh, gate_bias_.empty() ? nullptr : gate_bias_.data() + at,
                          up_bias_.empty() ? nullptr : up_bias_.data() + at, Gh, static_cast<int>(glu.kind),
                          glu.limit, glu.alpha, sc.h_bf16.data());
            } else {
              table_.silu_mul(cg, cg + Gh, Gh, sc.h_bf16.data());
            }
            store_tiled(h_row, (gl0 + b) * Gh * 2, sc.h_bf16.data(), Gh * 2);
          }
        }
      }
    };
    const int64_t a = item / pp.items_per_expert, first = item % pp.items_per_expert * per_item;
    const int64_t last = std::min(slice_groups, first + per_item);
    for (int64_t gl = first; gl < last; gl += blocks_per_call)
      gate_up_blocks(a, gl, std::min(blocks_per_call, last - gl));
    if (!ws.down_rows) return;
    // The worker that finishes an expert's last block completes its h and lets its down runs start.
    if (ps.ready[a].fetch_add(last - first, std::memory_order_acq_rel) + last - first < slice_groups) return;
    const int e = ws.active[a];
    if (int8_h)
      for (int64_t r = ws.offsets[e]; r < ws.offsets[e + 1]; ++r) quantize_h_row(ws, ps, slice, Gd, e, r);
    ps.ready[a].store(slice_groups + 1, std::memory_order_release);
  });
}

// The int8 h of large chunks (int8_h methods, per pool): rows [32 * block, 32 * block + 32) of the
// chunk quantized per group, once for all the output blocks of the down projection.
void MoeLayer::quantize_h_unit(const Chunk& chunk, const WorkerContext& ctx, int64_t block) {
  MoeWorkspace& ws = *workspace_;
  auto& ps = ws.pools[ctx.pool];
  const int64_t slice = pools_[ctx.pool]->i_end - pools_[ctx.pool]->i_begin;
  guarded(*runner_, ws.failed, [&] {
    for (int64_t r = block * kRowBlock; r < std::min((block + 1) * kRowBlock, ws.offsets[chunk.E]); ++r)
      quantize_h_row(ws, ps, slice, chunk.Gd, ws.row_expert[r], r);
  });
}

// Down (per pool): y[token] += weight * (h Wd^T) for every row. Large chunks: a unit is a block of
// output panels over every expert, so no two workers write the same element of the pool's y. Small
// chunks (down_rows): a unit is a run of (expert, panel) pairs, each row's projection stored apart,
// so that one unit can read an expert's whole slice in one run.
void MoeLayer::down_unit(const Chunk& chunk, const Plan& plan, const WorkerContext& ctx, int64_t unit) {
  MoeWorkspace& ws = *workspace_;
  const auto& [args, c0, Tc, E, K, P, G, Gd, H, Hp, Hy, Gh, int8_x, int8_h, gemm_q, down_q, gemm_a16,
               down_a16] = chunk;
  const PoolWeights& pw = *pools_[ctx.pool];
  auto& ps = ws.pools[ctx.pool];
  const int64_t slice = pw.i_end - pw.i_begin;
  const int64_t slice_groups = slice / Gh;
  const Plan::Pool& pp = plan.pools[ctx.pool];
  KernelScratch& sc = kernel_scratch();
  guarded(*runner_, ws.failed, [&] {
    if (slice == 0) return;
    const int64_t down_panel = panel_bytes(*config_.down_method, Gd, slice);
    const int64_t panels = Hy / kPanelWidth;
    // Output panels [p0, p0 + npan) of expert e for each of its rows: added into the pool's
    // y[token] with the row's weight, or (down_rows) stored in y[row].
    auto down_run = [&](int e, int64_t p0, int npan) {
      const uint8_t* w = pw.down + storage_[e] * pw.down_bytes + p0 * down_panel;
      const int64_t ldc = npan * kPanelWidth;
      const int64_t step = rows_per_call(ws.counts[e]);
      for (int64_t r0 = ws.offsets[e]; r0 < ws.offsets[e + 1]; r0 += step) {
        const int m = static_cast<int>(std::min<int64_t>(step, ws.offsets[e + 1] - r0));
        if (int8_h) {
          point_rows(sc, ws, e, r0, m, ps.h_q.data(), slice);
          for (int i = 0; i < m; ++i) {
            const int64_t pr = r0 + i + padding_before(ws, e);
            sc.ptr_s[i] = ps.h_scale.data() + pr * (slice / Gd),
            sc.ptr_m[i] = ps.h_sum.data() + pr * (slice / Gd);
          }
          const QuantRows h{reinterpret_cast<const int8_t* const*>(sc.ptr_a.data()), kTiledChunkStride,
                            reinterpret_cast<const float* const*>(sc.ptr_s.data()),
                            reinterpret_cast<const float* const*>(sc.ptr_m.data())};
          down_q(m, slice, Gd, h, w, npan, sc.c_buf.data(), ldc);
        } else {
          point_rows(sc, ws, e, r0, m, ps.h_rows.data(), slice * 2);
          down_a16(m, slice, Gd, sc.bf16_rows(), w, npan, sc.c_buf.data(), ldc);
        }
        for (int i = 0; i < m; ++i) {
          float* c = sc.c_buf.data() + i * ldc;
          if (!down_bias_.empty() && ctx.pool == down_bias_pool_) {  // once per row: pools' sums add up
            const float* b = down_bias_.data() + e * round_up(H, kPanelWidth) + p0 * kPanelWidth;
            for (int64_t j = 0; j < ldc; ++j) c[j] += b[j];
          }
          if (ws.down_rows)  // through c_buf: AMX stores whole blocks of rows, past row m - 1
            std::memcpy(ps.y.data() + (r0 + i) * Hy + p0 * kPanelWidth, c, ldc * sizeof(float));
          else
            table_.add_weighted(ps.y.data() + ws.row_token[r0 + i] * Hy + p0 * kPanelWidth, c,
                                ws.row_weight[r0 + i], ldc);
        }
      }
    };
    if (ws.down_rows) {
      grow(sc.c_buf, plan.max_rows * std::min<int64_t>(kMaxRunPanels, panels) * kPanelWidth);
      const int64_t u0 = pp.down_starts[unit], u1 = pp.down_starts[unit + 1];
      for (int64_t u = u0; u < u1;) {  // a run may end one expert's panels and start the next's
        const int64_t a = u / panels, p0 = u % panels, npan = std::min(panels - p0, u1 - u);
        wait_until(ps.ready[a], slice_groups + 1, ws.failed);  // its h complete
        down_run(ws.active[a], p0, static_cast<int>(npan));
        u += npan;
      }
    } else {
      grow(sc.c_buf, kRowChunk * pp.down_per_item * kPanelWidth);
      const int64_t p0 = unit * pp.down_per_item;
      const int npan = static_cast<int>(std::min<int64_t>(pp.down_per_item, panels - p0));
      for (int e : ws.active) down_run(e, p0, npan);
    }
  });
}

// Combine, a run of tokens' columns (`unit`: run * plan.splits + split): the pools' partial outputs
// (down_rows: each token's rows in slot order, weighted) summed into bf16, or fp32 (out_f32).
void MoeLayer::combine_item(const Chunk& chunk, const Plan& plan, int64_t unit) {
  MoeWorkspace& ws = *workspace_;
  const auto& [args, c0, Tc, E, K, P, G, Gd, H, Hp, Hy, Gh, int8_x, int8_h, gemm_q, down_q, gemm_a16,
               down_a16] = chunk;
  const int64_t t0 = unit / plan.splits * plan.tokens_per_unit, h0 = unit % plan.splits * plan.width;
  const int64_t n = std::min(H, h0 + plan.width) - h0;
  if (n <= 0) return;
  guarded(*runner_, ws.failed, [&] {
    thread_local std::vector<const float*> parts;
    thread_local std::vector<float> sum;
    grow(parts, P), grow(sum, Hy);
    for (int64_t t = t0; t < std::min(Tc, t0 + plan.tokens_per_unit); ++t) {
      const int64_t at = (c0 + t) * H + h0;
      auto emit = [&](const float* const* p, int np) {
        if (!args.out_f32) return table_.sum_to_bf16(p, np, n, args.incremental, args.out + at);
        float* out = args.out_f32 + at;
        for (int64_t i = 0; i < n; ++i) {
          float s = args.incremental ? out[i] : 0.0f;
          for (int q = 0; q < np; ++q) s += p[q][i];
          out[i] = s;
        }
      };
      if (ws.down_rows) {
        std::fill_n(sum.data(), n, 0.0f);
        for (int j = 0; j < K; ++j) {
          const int64_t r = ws.slot_row[t * K + j];
          if (r < 0) continue;
          for (int p = 0; p < P; ++p)
            if (pools_[p]->i_end > pools_[p]->i_begin)  // an empty slice stored nothing
              table_.add_weighted(sum.data(), ws.pools[p].y.data() + r * Hy + h0, ws.row_weight[r], n);
        }
        parts[0] = sum.data();
        emit(parts.data(), 1);
      } else {
        for (int p = 0; p < P; ++p) parts[p] = ws.pools[p].y.data() + t * Hy + h0;
        emit(parts.data(), P);
      }
    }
  });
}

}  // namespace kt
