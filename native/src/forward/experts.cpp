// The experts step (forward.h), per pool: gate/up and h, the int8 h of large chunks, down.
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "forward/forward.h"
#include "forward/rows.h"
#include "kernels/activations.h"
#include "kt/aligned_vector.h"
#include "kt/float_types.h"
#include "kt/quantize.h"
#include "kt/thread_scratch.h"

namespace kt {

namespace {

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

}  // namespace

// A pool's units of the experts step, taken in order: its gate/up items, then (large chunks of
// int8_h methods) its int8 h blocks, then its down units. Each waits only for what it reads, in
// its own pool: large chunks' h blocks for every gate/up item, their down units for every h block
// (or gate/up item); down_rows chunks' down runs for their expert's h (down_unit), with a client
// over every pool. Every unit waited for was taken before the waiting one (a pool's gate/up items
// wait for nothing), so the waits end.
void ForwardTask::experts_unit(int64_t unit, const WorkerContext& ctx) {
  const Plan::Pool& pp = plan_.pools[ctx.pool];
  auto& ps = ws_.pools[ctx.pool];
  if (unit < pp.gate_up_items) {
    gate_up_item(ctx, unit);
    ps.stage_done[0].fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  unit -= pp.gate_up_items;
  if (!ws_.down_rows && unit < pp.quantize_h_units) {
    wait_until(ps.stage_done[0], pp.gate_up_items, ws_.failed);
    quantize_h_unit(ctx, unit);
    ps.stage_done[1].fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  if (!ws_.down_rows) {
    unit -= pp.quantize_h_units;
    if (pp.quantize_h_units > 0)
      wait_until(ps.stage_done[1], pp.quantize_h_units, ws_.failed);
    else
      wait_until(ps.stage_done[0], pp.gate_up_items, ws_.failed);
  }
  down_unit(ctx, unit);
}

// Gate/up and h (per pool): h = silu(x Wg^T) * (x Wu^T), stored in bf16, for one expert and a run of
// blocks of intermediate channels (the unit gate and up are interleaved by): item `item` of the
// pool's plan. In down_rows chunks the worker that completes an expert's h in its pool also
// quantizes it (int8_h) and marks it ready for down; with a client, the one that completes it over
// every pool hands it to the client first.
void ForwardTask::gate_up_item(const WorkerContext& ctx, int64_t item) {
  MoeWorkspace& ws = ws_;
  const Chunk& c = chunk_;
  const MoeLayer::PackedSlice pw = layer_.packed_slice(ctx.pool);
  auto& ps = ws.pools[ctx.pool];
  const int64_t slice = pw.i_end - pw.i_begin;
  const int64_t slice_groups = slice / c.Gh;
  const Plan::Pool& pp = plan_.pools[ctx.pool];
  KernelScratch& sc = kernel_scratch();
  guarded(layer_.runner(), ws.failed, [&] {
    const int64_t Gh = c.Gh, Hp = c.Hp;
    const Method method = layer_.config().method;
    const int npan = static_cast<int>(Gh / kPanelWidth);
    const int64_t block_bytes = 2 * npan * panel_bytes(method, c.G, Hp);
    const int64_t per_item = pp.per_item, blocks_per_call = pp.blocks_per_call;
    grow(sc.h_bf16, blocks_per_call * Gh);
    grow(sc.c_buf, plan_.max_rows * blocks_per_call * 2 * Gh);
    const GluConfig& glu = layer_.config().glu;
    const bool general_glu = !glu.plain() || biases_.gate || biases_.up;
    const int64_t intermediate_padded = layer_.intermediate_padded();
    // Blocks [gl0, gl0 + nb) of expert ws.active[a]: its intermediate channels [gl0 * Gh,
    // (gl0 + nb) * Gh) of the slice.
    auto gate_up_blocks = [&](int64_t a, int64_t gl0, int64_t nb) {
      const int e = ws.active[a];
      const uint8_t* w = pw.gate_up + layer_.storage()[e] * pw.gate_up_bytes + gl0 * block_bytes;
      const int64_t ldc = 2 * Gh * nb;
      const int panels = static_cast<int>(2 * npan * nb);
      const int64_t step = rows_per_call(ws.counts[e]);
      for (int64_t r0 = ws.offsets[e]; r0 < ws.offsets[e + 1]; r0 += step) {
        const int m = static_cast<int>(std::min<int64_t>(step, ws.offsets[e + 1] - r0));
        if (ws.a16[e]) {
          point_rows(sc, ws, e, r0, m, ws.x_rows16.data(), Hp * 2);
          c.gemm_a16(m, Hp, c.G, sc.bf16_rows(), w, panels, sc.c_buf.data(), ldc);
        } else if (c.int8_x) {
          point_rows(sc, ws, e, r0, m, ws.x_rows.data(), Hp);
          for (int i = 0; i < m; ++i) {
            const int64_t t = ws.row_token[r0 + i];
            sc.ptr_s[i] = ws.x_scale.data() + t * (Hp / c.G), sc.ptr_m[i] = ws.x_sum.data() + t * (Hp / c.G);
          }
          const QuantRows x{reinterpret_cast<const int8_t* const*>(sc.ptr_a.data()), kTiledChunkStride,
                            reinterpret_cast<const float* const*>(sc.ptr_s.data()),
                            reinterpret_cast<const float* const*>(sc.ptr_m.data())};
          c.gemm_q(m, Hp, c.G, x, w, panels, sc.c_buf.data(), ldc);
        } else {
          point_rows(sc, ws, e, r0, m, ws.x_rows.data(), Hp * 2);
          c.gemm_a16(m, Hp, c.G, sc.bf16_rows(), w, panels, sc.c_buf.data(), ldc);
        }
        const int64_t i0 = pw.i_begin + gl0 * Gh;
        if (client_) client_->gate_up_epilogue(e, r0, m, i0, nb, Gh, sc.c_buf.data(), ldc);
        for (int i = 0; i < m; ++i) {
          for (int64_t b = 0; b < nb; ++b) {
            const float* cg = sc.c_buf.data() + i * ldc + b * 2 * Gh;
            uint16_t* h = sc.h_bf16.data() + b * Gh;
            if (general_glu) {
              const int64_t at = e * intermediate_padded + i0 + b * Gh;
              glu_general(cg, cg + Gh, biases_.gate ? biases_.gate + at : nullptr,
                          biases_.up ? biases_.up + at : nullptr, Gh, static_cast<int>(glu.kind), glu.limit,
                          glu.alpha, h);
            } else {
              table_.silu_mul(cg, cg + Gh, Gh, h);
            }
          }
          uint8_t* h_row = tiled_row(ps.h_rows.data(), r0 + i + padding_before(ws, e), slice * 2);
          store_tiled(h_row, gl0 * Gh * 2, sc.h_bf16.data(), nb * Gh * 2);
          if (client_) client_->keep_h(r0 + i, i0, sc.h_bf16.data(), nb * Gh);
        }
      }
    };
    const int64_t a = item / pp.items_per_expert, first = item % pp.items_per_expert * per_item;
    const int64_t last = std::min(slice_groups, first + per_item);
    for (int64_t gl = first; gl < last; gl += blocks_per_call)
      gate_up_blocks(a, gl, std::min(blocks_per_call, last - gl));
    if (!ws.down_rows) return;
    // The worker that finishes an expert's last block completes its h and lets its down runs start.
    const int e = ws.active[a];
    const int64_t blocks = last - first;
    if (ps.ready[a].fetch_add(blocks, std::memory_order_acq_rel) + blocks == slice_groups) {
      if (c.int8_h)
        for (int64_t r = ws.offsets[e]; r < ws.offsets[e + 1]; ++r) quantize_h_row(ws, ps, slice, c.Gd, e, r);
      ps.ready[a].store(slice_groups + 1, std::memory_order_release);
    }
    if (client_ && ws.h_done[a].fetch_add(blocks, std::memory_order_acq_rel) + blocks == plan_.h_blocks) {
      client_->expert_h_done(e);
      ws.h_done[a].store(plan_.h_blocks + 1, std::memory_order_release);
    }
  });
}

// The int8 h of large chunks (int8_h methods, per pool): rows [32 * block, 32 * block + 32) of the
// chunk quantized per group, once for all the output blocks of the down projection.
void ForwardTask::quantize_h_unit(const WorkerContext& ctx, int64_t block) {
  MoeWorkspace& ws = ws_;
  auto& ps = ws.pools[ctx.pool];
  const MoeLayer::PackedSlice pw = layer_.packed_slice(ctx.pool);
  const int64_t slice = pw.i_end - pw.i_begin;
  guarded(layer_.runner(), ws.failed, [&] {
    for (int64_t r = block * kRowBlock; r < std::min((block + 1) * kRowBlock, ws.offsets[chunk_.E]); ++r)
      quantize_h_row(ws, ps, slice, chunk_.Gd, ws.row_expert[r], r);
  });
}

// Down (per pool): y[token] += weight * (h Wd^T) for every row. Large chunks: a unit is a block of
// output panels over every expert, so no two workers write the same element of the pool's y.
// down_rows chunks: a unit is a run of (expert, panel) pairs, each row's projection stored apart,
// so that one unit can read an expert's whole slice in one run.
void ForwardTask::down_unit(const WorkerContext& ctx, int64_t unit) {
  MoeWorkspace& ws = ws_;
  const Chunk& c = chunk_;
  const MoeLayer::PackedSlice pw = layer_.packed_slice(ctx.pool);
  auto& ps = ws.pools[ctx.pool];
  const int64_t slice = pw.i_end - pw.i_begin;
  const int64_t slice_groups = slice / c.Gh;
  const Plan::Pool& pp = plan_.pools[ctx.pool];
  KernelScratch& sc = kernel_scratch();
  guarded(layer_.runner(), ws.failed, [&] {
    if (slice == 0) return;
    const int64_t Hy = c.Hy, Gd = c.Gd;
    const int64_t down_panel = panel_bytes(*layer_.config().down_method, Gd, slice);
    const int64_t panels = Hy / kPanelWidth;
    const bool down_bias = biases_.down && ctx.pool == biases_.down_pool;  // once per row: pools' sums add up
    // Output panels [p0, p0 + npan) of expert e for each of its rows: added into the pool's
    // y[token] with the row's weight (through c_buf), or (down_rows) written in place at the row's
    // padded index: AMX stores whole blocks of rows, past row m - 1, into the expert's padding.
    auto down_run = [&](int e, int64_t p0, int npan) {
      const uint8_t* w = pw.down + layer_.storage()[e] * pw.down_bytes + p0 * down_panel;
      const int64_t n = npan * kPanelWidth;
      const int64_t step = rows_per_call(ws.counts[e]);
      for (int64_t r0 = ws.offsets[e]; r0 < ws.offsets[e + 1]; r0 += step) {
        const int m = static_cast<int>(std::min<int64_t>(step, ws.offsets[e + 1] - r0));
        float* out = ws.down_rows ? ps.y.data() + (r0 + padding_before(ws, e)) * Hy + p0 * kPanelWidth
                                  : sc.c_buf.data();
        const int64_t ldo = ws.down_rows ? Hy : n;
        if (c.int8_h) {
          point_rows(sc, ws, e, r0, m, ps.h_q.data(), slice);
          for (int i = 0; i < m; ++i) {
            const int64_t pr = r0 + i + padding_before(ws, e);
            sc.ptr_s[i] = ps.h_scale.data() + pr * (slice / Gd),
            sc.ptr_m[i] = ps.h_sum.data() + pr * (slice / Gd);
          }
          const QuantRows h{reinterpret_cast<const int8_t* const*>(sc.ptr_a.data()), kTiledChunkStride,
                            reinterpret_cast<const float* const*>(sc.ptr_s.data()),
                            reinterpret_cast<const float* const*>(sc.ptr_m.data())};
          c.down_q(m, slice, Gd, h, w, npan, out, ldo);
        } else {
          point_rows(sc, ws, e, r0, m, ps.h_rows.data(), slice * 2);
          c.down_a16(m, slice, Gd, sc.bf16_rows(), w, npan, out, ldo);
        }
        if (client_) client_->down_epilogue(ctx.pool, e, r0, m, p0 * kPanelWidth, n, out, ldo);
        if (ws.down_rows && !down_bias) continue;
        for (int i = 0; i < m; ++i) {
          float* row = out + i * ldo;
          if (down_bias) {
            const float* b = biases_.down + e * Hy + p0 * kPanelWidth;
            for (int64_t j = 0; j < n; ++j) row[j] += b[j];
          }
          if (!ws.down_rows)
            table_.add_weighted(ps.y.data() + ws.row_token[r0 + i] * Hy + p0 * kPanelWidth, row,
                                ws.row_weight[r0 + i], n);
        }
      }
    };
    if (ws.down_rows) {
      const int64_t u0 = pp.down_starts[unit], u1 = pp.down_starts[unit + 1];
      for (int64_t u = u0; u < u1;) {  // a run may end one expert's panels and start the next's
        const int64_t a = u / panels, p0 = u % panels, npan = std::min(panels - p0, u1 - u);
        wait_until(ps.ready[a], slice_groups + 1, ws.failed);                  // its h complete
        if (client_) wait_until(ws.h_done[a], plan_.h_blocks + 1, ws.failed);  // and seen by the client
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

}  // namespace kt
