// The forward's first steps (forward.h): the batch size, each chunk's routing, and the plan of the
// routed chunk's units.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "forward/forward.h"
#include "forward/rows.h"
#include "kt/quantize.h"

namespace kt {

namespace {

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

// Rows of the longest kernel call: a token may name an expert twice, so up to Tc * top_k.
int64_t max_rows_per_call(const MoeWorkspace& ws) {
  int64_t max_rows = 0;
  for (int e : ws.active) max_rows = std::max(max_rows, rows_per_call(ws.counts[e]));
  return max_rows;
}

}  // namespace

// Reads the batch size (at run time when args.tokens_ptr is set) and routes the first chunk.
bool ForwardTask::start() {
  ws_.tokens = args_.tokens_ptr ? *args_.tokens_ptr : args_.tokens;
  grow(ws_.pools, static_cast<size_t>(chunk_.P));
  if (ws_.tokens < 0 || (args_.max_tokens > 0 && ws_.tokens > args_.max_tokens)) {
    const std::string bound =
        args_.max_tokens > 0 ? "outside [0, " + std::to_string(args_.max_tokens) + "] (the buffers' capacity)"
                             : "negative";
    throw std::invalid_argument("forward: the batch size read at run time is " + std::to_string(ws_.tokens) +
                                ", " + bound);
  }
  if (ws_.tokens == 0) return false;
  chunk_.Tc = std::min(chunk_.max_tokens, ws_.tokens);
  route();
  return true;
}

// Routing: groups chunk [c0, c0 + Tc)'s rows by expert and sizes the buffers; sets
// ws.bad_routing on failure.
void ForwardTask::route() {
  MoeWorkspace& ws = ws_;
  const Chunk& c = chunk_;
  const int64_t elem = c.int8_x ? 1 : 2;  // bytes per gathered activation value
  const MoeConfig& config = layer_.config();
  const int a16_min_rows = config.int8_input_per_row ? 0 : table_.method(config.method).gate_up_a16_min_rows;
  const int h_per_row_min_rows = table_.method(*config.down_method).down_h_per_row_min_rows;
  ws.bad_routing = true;  // until routing succeeds
  ws.failed.store(false, std::memory_order_relaxed);
  guarded(layer_.runner(), ws.failed, [&] {
    if (args_.tokens_ptr) {  // read at run time: submit could not check them
      const size_t bytes = args_.ids_int64 ? sizeof(int64_t) : sizeof(int32_t);
      check_expert_ids(static_cast<const uint8_t*>(args_.expert_ids) + c.c0 * c.K * bytes, args_.ids_int64,
                       c.Tc, c.K, c.E, c.c0);
    }
    route_rows({args_.expert_ids, args_.ids_int64, args_.weights, args_.skip_mask}, c.c0, c.Tc, c.K, c.E,
               layer_.storage().data(), ws);
    ws.padded_offsets.assign(c.E + 1, 0);
    ws.a16.assign(c.E, 0);
    ws.h_per_row.assign(c.E, 0);
    bool any_a16 = false;
    for (int e = 0; e < c.E; ++e) {
      ws.padded_offsets[e + 1] = ws.padded_offsets[e] + round_up(ws.counts[e], kRowBlock);
      ws.a16[e] = c.int8_x && a16_min_rows > 0 && ws.counts[e] >= a16_min_rows;
      any_a16 = any_a16 || ws.a16[e];
      ws.h_per_row[e] = c.int8_h && (config.int8_input_per_row ||
                                     (h_per_row_min_rows > 0 && ws.counts[e] >= h_per_row_min_rows));
    }
    const int64_t Rp = ws.padded_offsets[c.E];
    const size_t active = ws.active.size();
    if (c.int8_x)
      grow(ws.x_q, c.Tc * c.Hp), grow(ws.x_scale, c.Tc * c.Hp / c.G), grow(ws.x_sum, c.Tc * c.Hp / c.G);
    ws.down_rows = c.Tc <= kMaxDownRowsTokens || client_;
    grow(ws.x_rows, Rp * c.Hp * elem);
    if (any_a16) grow(ws.x_rows16, Rp * c.Hp * 2);
    for (int p = 0; p < c.P; ++p) {
      auto& ps = ws.pools[p];
      const MoeLayer::PackedSlice pw = layer_.packed_slice(p);
      const int64_t slice = pw.i_end - pw.i_begin;
      grow(ps.h_rows, Rp * slice * 2);
      if (c.int8_h)
        grow(ps.h_q, Rp * slice), grow(ps.h_scale, Rp * slice / c.Gd), grow(ps.h_sum, Rp * slice / c.Gd);
      grow(ps.y, (ws.down_rows ? Rp : c.Tc) * c.Hy);
      if (ps.ready_size < active) {
        ps.ready = std::make_unique<std::atomic<int64_t>[]>(active);
        ps.ready_size = active;
      }
      for (size_t a = 0; a < active; ++a) ps.ready[a].store(0, std::memory_order_relaxed);
      for (int stage = 0; stage < 2; ++stage) ps.stage_done[stage].store(0, std::memory_order_relaxed);
    }
    if (client_) {
      if (ws.h_done_size < active) {
        ws.h_done = std::make_unique<std::atomic<int64_t>[]>(active);
        ws.h_done_size = active;
      }
      for (size_t a = 0; a < active; ++a) ws.h_done[a].store(0, std::memory_order_relaxed);
      client_->routed(ws, c.Tc);
    }
    ws.bad_routing = false;
  });
}

// The units of the routed chunk's steps: as long as each pool's balance allows.
void ForwardTask::plan_steps() {
  const MoeWorkspace& ws = ws_;
  const Chunk& c = chunk_;
  Plan& plan = plan_;
  const int64_t active = static_cast<int64_t>(ws.active.size());
  const int threads = layer_.runner().num_threads();
  plan.max_rows = max_rows_per_call(ws);
  plan.tokens_per_unit = std::max<int64_t>(1, c.Tc / (4 * threads));
  plan.token_units = (c.Tc + plan.tokens_per_unit - 1) / plan.tokens_per_unit;
  plan.client_units = client_ ? client_->gather_units() : 0;
  plan.h_blocks = 0;
  const int64_t panels = c.Hy / kPanelWidth;
  for (int p = 0; p < c.P; ++p) {
    Plan::Pool& pp = plan.pools[p];
    const int64_t pool_size = static_cast<int64_t>(layer_.runner().pool(p).cpus.size());
    const MoeLayer::PackedSlice pw = layer_.packed_slice(p);
    const int64_t slice = pp.slice = pw.i_end - pw.i_begin;
    const int64_t slice_groups = slice / c.Gh;
    plan.h_blocks += slice_groups;
    pp.per_item = std::clamp<int64_t>(active * slice_groups / (kMinGateUpItemsPerWorker * pool_size), 1,
                                      kMaxGateUpBlocks);
    pp.items_per_expert = (slice_groups + pp.per_item - 1) / pp.per_item;
    // Small chunks run an item's blocks in one kernel call, one uninterrupted pass over its
    // weights (Zen 4, Qwen3 INT4 at T=1: x1.03-1.04 when the host's bandwidth is high); large
    // ones one block per call, so that c_buf stays within the L2.
    pp.blocks_per_call = c.Tc <= kMaxDownRowsTokens ? pp.per_item : 1;
    pp.gate_up_items = pp.items_per_expert * active;
    pp.quantize_h_units = c.int8_h && slice > 0 ? (ws.offsets[c.E] + kRowBlock - 1) / kRowBlock : 0;
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
  plan.splits = std::max<int64_t>(1, threads / c.Tc);
  plan.width = round_up((c.H + plan.splits - 1) / plan.splits, kPanelWidth);
  plan.combine_units = plan.token_units * plan.splits;
}

}  // namespace kt
