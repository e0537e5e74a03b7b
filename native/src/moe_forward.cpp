// The forward task of MoeLayer and its steps, in the order they run per chunk of tokens.
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
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

// Takes ranges of [0, n) from a shared cursor until none is left, each `size(left)` long (clipped
// to what is left), so that they can narrow as the work runs out.
template <class Size, class F>
void for_each_range(std::atomic<int64_t>& cursor, int64_t n, Size&& size, F&& body) {
  for (int64_t begin = cursor.load(std::memory_order_relaxed); begin < n;) {
    const int64_t len = std::clamp<int64_t>(size(n - begin), 1, n - begin);
    if (cursor.compare_exchange_weak(begin, begin + len, std::memory_order_relaxed)) {
      body(begin, len);
      begin = cursor.load(std::memory_order_relaxed);
    }
  }
}

// The first row r >= begin with r % workers == rank. Rows are dealt round-robin by their index over
// all experts: dealt per expert, the 8 one-row experts of a decode step all went to worker 0.
int64_t first_row_of(int64_t begin, int rank, int workers) {
  return begin + ((rank - begin) % workers + workers) % workers;
}

}  // namespace

namespace {

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

// Rows of the longest kernel call: a token may name an expert twice, so up to Tc * top_k.
int64_t max_rows_per_call(const MoeWorkspace& ws) {
  int64_t max_rows = 0;
  for (int e : ws.active) max_rows = std::max(max_rows, rows_per_call(ws.counts[e]));
  return max_rows;
}

}  // namespace

// A task runs on every worker of every pool: per chunk of tokens, route (worker 0), gather the
// inputs, gate/up and h (per pool), the int8 h of large chunks, down (per pool), combine; barriers
// between the steps that read what another worker wrote.
void MoeLayer::forward_task(const ForwardArgs& args, const WorkerContext& ctx) {
  MoeWorkspace& ws = *workspace_;
  const MethodKernels& kernels = table_.method(config_.method);
  const MethodKernels& down_kernels = table_.method(*config_.down_method);
  Chunk chunk{args,
              0,
              0,
              config_.num_experts,
              config_.top_k,
              static_cast<int>(pools_.size()),
              group_,
              config_.down_group,
              config_.hidden,
              hidden_padded_,
              round_up(config_.hidden, kPanelWidth),
              h_group(),
              method_traits(config_.method).gate_up_input == Activation::kInt8,
              method_traits(*config_.down_method).down_input == Activation::kInt8,
              kernels.gemm_q8,
              down_kernels.gemm_q8,
              kernels.gemm_a16,
              down_kernels.gemm_a16};

  // Worker 0 reads the batch size and routes the first chunk before the first barrier: at T=1 each
  // barrier is a few us of a ~400 us layer.
  if (ctx.tid == 0) {
    ws.tokens = args.tokens_ptr ? *args.tokens_ptr : args.tokens;
    ws.bad_batch = ws.tokens < 0 || (args.max_tokens > 0 && ws.tokens > args.max_tokens);
    if (ws.bad_batch) {
      const std::string bound =
          args.max_tokens > 0 ? "outside [0, " + std::to_string(args.max_tokens) + "] (the buffers' capacity)"
                              : "negative";
      runner_->record_error(std::make_exception_ptr(std::invalid_argument(
          "forward: the batch size read at run time is " + std::to_string(ws.tokens) + ", " + bound)));
    }
    grow(ws.pools, static_cast<size_t>(chunk.P));
    if (!ws.bad_batch && ws.tokens > 0) {
      chunk.Tc = std::min(config_.max_chunk_tokens, ws.tokens);
      route(chunk);
    }
  }
  ctx.barrier();
  if (ws.bad_batch) return;
  const int64_t T = ws.tokens;

  for (chunk.c0 = 0; chunk.c0 < T; chunk.c0 += config_.max_chunk_tokens) {
    chunk.Tc = std::min(config_.max_chunk_tokens, T - chunk.c0);
    if (chunk.c0 > 0) {
      if (ctx.tid == 0) route(chunk);
      ctx.barrier();
    }
    if (ws.bad_routing) return;
    gather_inputs(chunk, ctx);
    ctx.barrier();
    gate_up(chunk, ctx);
    if (!ws.down_rows) {  // small chunks: each expert's down starts when its h is complete instead
      ctx.pool_barrier();
      const int64_t slice = pools_[ctx.pool]->i_end - pools_[ctx.pool]->i_begin;
      if (chunk.int8_h && slice > 0) {
        quantize_h(chunk, ctx);
        ctx.pool_barrier();
      }
    }
    down(chunk, ctx);
    ctx.barrier();
    combine(chunk, ctx);
    if (chunk.c0 + chunk.Tc < T)
      ctx.barrier();  // after the last chunk, the runner's own barrier ends the task
  }
}

// Routing (worker 0): groups chunk [c0, c0 + Tc)'s rows by expert and sizes the buffers; sets
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
      for (auto& c : ws.phase_counter[p]) c.value.store(0);
    }
    ws.bad_routing = false;
  });
}

// Gather/quantize: each token's input quantized once for all its experts (int8_x), then gathered
// into each of its rows in the tiled layout; its partial sums cleared. A worker gathers the tokens
// it quantized, so the two steps need no barrier between them.
void MoeLayer::gather_inputs(const Chunk& chunk, const WorkerContext& ctx) {
  MoeWorkspace& ws = *workspace_;
  const auto& [args, c0, Tc, E, K, P, G, Gd, H, Hp, Hy, Gh, int8_x, int8_h, gemm_q, down_q, gemm_a16,
               down_a16] = chunk;
  guarded(*runner_, ws.failed, [&] {
    thread_local std::vector<float> row;
    thread_local std::vector<uint16_t> padded;
    grow(row, Hp), grow(padded, Hp);
    const int64_t H_whole = H / (kChunkBytes / 2) * (kChunkBytes / 2);  // bf16 values in whole chunks
    for (int64_t t = ctx.tid; t < Tc; t += ctx.num_threads) {
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
// blocks of intermediate channels (the unit gate and up are interleaved by). In small chunks the
// worker that completes an expert's h also quantizes it (int8_h) and marks it ready for down.
void MoeLayer::gate_up(const Chunk& chunk, const WorkerContext& ctx) {
  MoeWorkspace& ws = *workspace_;
  const auto& [args, c0, Tc, E, K, P, G, Gd, H, Hp, Hy, Gh, int8_x, int8_h, gemm_q, down_q, gemm_a16,
               down_a16] = chunk;
  const PoolWeights& pw = *pools_[ctx.pool];
  auto& ps = ws.pools[ctx.pool];
  const int64_t slice = pw.i_end - pw.i_begin;
  const int64_t slice_groups = slice / Gh;
  const int64_t max_rows = max_rows_per_call(ws);
  KernelScratch& sc = kernel_scratch();
  guarded(*runner_, ws.failed, [&] {
    const int npan = static_cast<int>(Gh / kPanelWidth);
    grow(sc.h_bf16, Gh);
    const int64_t block_bytes = 2 * npan * panel_bytes(config_.method, G, Hp);
    const int64_t blocks = static_cast<int64_t>(ws.active.size()) * slice_groups;
    const int64_t per_item =
        std::clamp<int64_t>(blocks / (kMinGateUpItemsPerWorker * ctx.pool_size), 1, kMaxGateUpBlocks);
    const int64_t items_per_expert = (slice_groups + per_item - 1) / per_item;
    // Small chunks run an item's blocks in one kernel call, one uninterrupted pass over its
    // weights (Zen 4, Qwen3 INT4 at T=1: x1.03-1.04 when the host's bandwidth is high); large
    // ones one block per call, so that c_buf stays within the L2.
    const int64_t blocks_per_call = ws.down_rows ? per_item : 1;
    grow(sc.c_buf, max_rows * blocks_per_call * 2 * Gh);
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
    for_each_item(
        ws.phase_counter[ctx.pool][0].value, items_per_expert * static_cast<int64_t>(ws.active.size()),
        [&](int64_t item) {
          const int64_t a = item / items_per_expert, first = item % items_per_expert * per_item;
          const int64_t last = std::min(slice_groups, first + per_item);
          for (int64_t gl = first; gl < last; gl += blocks_per_call)
            gate_up_blocks(a, gl, std::min(blocks_per_call, last - gl));
          if (!ws.down_rows) return;
          // The worker that finishes an expert's last block completes its h and lets
          // its down runs start.
          if (ps.ready[a].fetch_add(last - first, std::memory_order_acq_rel) + last - first < slice_groups)
            return;
          const int e = ws.active[a];
          if (int8_h)
            for (int64_t r = ws.offsets[e]; r < ws.offsets[e + 1]; ++r)
              quantize_h_row(ws, ps, slice, Gd, e, r);
          ps.ready[a].store(slice_groups + 1, std::memory_order_release);
        });
  });
}

// The int8 h of large chunks (int8_h methods, per pool): each row's h quantized per group, once
// for all the output blocks of the down projection.
void MoeLayer::quantize_h(const Chunk& chunk, const WorkerContext& ctx) {
  MoeWorkspace& ws = *workspace_;
  auto& ps = ws.pools[ctx.pool];
  const int64_t slice = pools_[ctx.pool]->i_end - pools_[ctx.pool]->i_begin;
  const int G = chunk.Gd;
  guarded(*runner_, ws.failed, [&] {
    for (int e : ws.active)
      for (int64_t r = first_row_of(ws.offsets[e], ctx.rank_in_pool, ctx.pool_size); r < ws.offsets[e + 1];
           r += ctx.pool_size)
        quantize_h_row(ws, ps, slice, G, e, r);
  });
}

// Down (per pool): y[token] += weight * (h Wd^T) for every row. Large chunks: items are blocks of
// output panels over every expert, so no two workers write the same element of the pool's y. Small
// chunks (down_rows): items are runs of (expert, panel) pairs, each row's projection stored apart,
// so that one item can read an expert's whole slice in one run.
void MoeLayer::down(const Chunk& chunk, const WorkerContext& ctx) {
  MoeWorkspace& ws = *workspace_;
  const auto& [args, c0, Tc, E, K, P, G, Gd, H, Hp, Hy, Gh, int8_x, int8_h, gemm_q, down_q, gemm_a16,
               down_a16] = chunk;
  const PoolWeights& pw = *pools_[ctx.pool];
  auto& ps = ws.pools[ctx.pool];
  const int64_t slice = pw.i_end - pw.i_begin;
  const int64_t slice_groups = slice / Gh;
  const int64_t max_rows = max_rows_per_call(ws);
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
    auto& counter = ws.phase_counter[ctx.pool][1].value;
    if (ws.down_rows) {
      const int64_t max_panels = std::min<int64_t>(kMaxRunPanels, panels);
      grow(sc.c_buf, max_rows * max_panels * kPanelWidth);
      // Long runs first, shorter ones as the work runs out, so the workers finish together.
      auto run_panels = [&](int64_t left) {
        return std::min(max_panels,
                        std::max<int64_t>(kMinDownPanels, left / (kDownItemsPerWorker * ctx.pool_size)));
      };
      const int64_t units = static_cast<int64_t>(ws.active.size()) * panels;
      // Waits until expert a's h is complete. Every gate/up item was taken before any down range,
      // so the wait ends unless the worker holding one failed.
      auto wait_ready = [&](int64_t a) {
        for (int i = 0; ps.ready[a].load(std::memory_order_acquire) <= slice_groups; ++i) {
          if (ws.failed.load(std::memory_order_acquire))
            throw std::runtime_error("forward: stopped after another worker failed");
          if (i < 4096)
            _mm_pause();
          else
            sched_yield();
        }
      };
      for_each_range(counter, units, run_panels, [&](int64_t u0, int64_t n) {
        for (int64_t u = u0; u < u0 + n;) {  // a range may end one expert's run and start the next
          const int64_t a = u / panels, p0 = u % panels, npan = std::min(panels - p0, u0 + n - u);
          wait_ready(a);
          down_run(ws.active[a], p0, static_cast<int>(npan));
          u += npan;
        }
      });
    } else {
      // Few, wide items (h is re-read per item, and each expert's run of weights is longer).
      const int per_item = static_cast<int>(std::clamp<int64_t>(
          panels / (kDownItemsPerWorker * ctx.pool_size), kMinDownPanels, kMaxDownPanels));
      grow(sc.c_buf, kRowChunk * per_item * kPanelWidth);
      for_each_item(counter, (panels + per_item - 1) / per_item, [&](int64_t b) {
        const int64_t p0 = b * per_item;
        const int npan = static_cast<int>(std::min<int64_t>(per_item, panels - p0));
        for (int e : ws.active) down_run(e, p0, npan);
      });
    }
  });
}

// Combine: the pools' partial outputs (down_rows: each token's rows in slot order, weighted) summed
// into bf16, or fp32 (out_f32).
void MoeLayer::combine(const Chunk& chunk, const WorkerContext& ctx) {
  MoeWorkspace& ws = *workspace_;
  const auto& [args, c0, Tc, E, K, P, G, Gd, H, Hp, Hy, Gh, int8_x, int8_h, gemm_q, down_q, gemm_a16,
               down_a16] = chunk;
  guarded(*runner_, ws.failed, [&] {
    thread_local std::vector<const float*> parts;
    thread_local std::vector<float> sum;
    grow(parts, P), grow(sum, Hy);
    // With fewer tokens than workers (decode) each token's columns are split among them.
    const int64_t splits = std::max<int64_t>(1, ctx.num_threads / Tc);
    const int64_t width = round_up((H + splits - 1) / splits, kPanelWidth);
    for (int64_t item = ctx.tid; item < Tc * splits; item += ctx.num_threads) {
      const int64_t t = item / splits, h0 = item % splits * width, n = std::min(H, h0 + width) - h0;
      if (n <= 0) continue;
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
