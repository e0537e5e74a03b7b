#include "kt/moe_layer.h"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/activations.h"
#include "kt/aligned_vector.h"
#include "kt/packing.h"
#include "kt/thread_scratch.h"
#include "kt/topology.h"
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
constexpr int kMaxPools = 64;

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

// The routing of the current chunk is its ExpertRows (routing.h).
struct MoeWorkspace : ExpertRows {
  int64_t tokens = 0;  // the batch's
  // [E + 1]: each expert's rows start a new block of 32 in the gathered buffers, so AMX reads them
  // as tiles.
  std::vector<int64_t> padded_offsets;
  // Set by worker 0, read by all after a barrier. Two flags: the start check and a chunk's routing
  // have no barrier between them, so one flag could be rewritten while a worker still reads it.
  bool bad_batch = false;
  bool bad_routing = false;
  // Per token: int8 input + scales (quantized methods).
  std::vector<int8_t> x_q;
  std::vector<float> x_scale, x_sum;
  // Per row, gathered in the tiled layout: the input (int8 or bf16); for experts whose gate/up runs
  // the A16 kernel (a16[e]), bf16 in x_rows16 instead, at the same padded rows.
  AlignedVector<uint8_t> x_rows, x_rows16;
  std::vector<char> a16;  // [E]
  // int8_h methods: experts whose down projection reads the bf16 h through the A16 kernel
  // (MethodKernels::down_a16_min_rows); their h is not quantized.
  std::vector<char> down_a16;  // [E]
  struct PoolScratch {
    AlignedVector<uint8_t> h_rows;  // per row, tiled: the bf16 intermediate (every method)
    // int8_h methods: h per row quantized to int8 (tiled, same padded rows), scales and sums per group
    AlignedVector<uint8_t> h_q;
    std::vector<float> h_scale, h_sum;
    std::vector<float> y;  // fp32 partial output [tokens, hidden padded to 16] (down_rows: [rows, ...])
    // down_rows chunks, per active expert: its gate/up blocks done, plus one once its h is complete
    // (int8_h: quantized). An expert's down runs start on that, not on a barrier after all of gate/up.
    std::unique_ptr<std::atomic<int64_t>[]> ready;
    size_t ready_size = 0;
  };
  std::vector<PoolScratch> pools;
  // Small chunks (kMaxDownRowsTokens): each pool's y holds every row's down projection, summed per
  // token in slot order in phase 4, whichever worker computed it (the result is reproducible).
  bool down_rows = false;
  std::atomic<bool> failed{false};  // a worker failed in this chunk: whoever waits on ready stops
  PaddedCounter phase_counter[kMaxPools][3];
  PaddedCounter load_counter;
};

std::shared_ptr<MoeWorkspace> make_workspace() {
  return std::make_shared<MoeWorkspace>();
}

// One pool's slice [i_begin, i_end) of every expert. Gate and up are interleaved per group of
// intermediate channels (the group's gate panels, then its up panels) so that one kernel call
// computes both from one pass over the activations.
struct MoeLayer::PoolWeights {
  int node = 0;
  int64_t i_begin = 0, i_end = 0;
  PackRegion gate_region, down_region;
  int64_t gate_up_bytes = 0, down_bytes = 0;  // per expert
  size_t gate_up_alloc = 0, down_alloc = 0;   // all experts, on the pool's node
  uint8_t* gate_up = nullptr;
  uint8_t* down = nullptr;
  ~PoolWeights() {
    free_on_node(gate_up, gate_up_alloc);
    free_on_node(down, down_alloc);
  }
};

MoeLayer::MoeLayer(const MoeConfig& config, std::shared_ptr<Runner> runner,
                   std::shared_ptr<MoeWorkspace> workspace, Isa isa)
    : config_(config),
      runner_(std::move(runner)),
      workspace_(std::move(workspace)),
      table_(kernel_table(isa)) {
  weight_prefetch_bytes();  // an invalid KT_SGLANG_PREFETCH_BYTES fails here, not in a worker
  // Each projection's group: the one given, else its method's default; one its kernels take.
  auto resolve_group = [](Method method, int group, const char* projection) {
    const MethodTraits& traits = method_traits(method);
    const int g = group == 0 ? traits.default_group : group;
    if (!group_allowed(method, g)) {
      std::string allowed;
      for (int a : traits.allowed_groups)
        if (a) allowed += (allowed.empty() ? "" : ", ") + std::to_string(a);
      throw std::invalid_argument(std::string(projection) + "group size " + std::to_string(g) +
                                  " is not allowed for " + traits.name + ": use " + allowed);
    }
    return g;
  };
  group_ = resolve_group(config_.method, config_.group, "");
  if (!config_.down_method) config_.down_method = config_.method, config_.down_group = group_;
  config_.down_group = resolve_group(*config_.down_method, config_.down_group, "down projection: ");
  if (config_.num_experts < 1 || config_.top_k < 1 || config_.top_k > config_.num_experts)
    throw std::invalid_argument("need 1 <= top_k <= num_experts");
  if (config_.hidden < 1 || config_.intermediate < 1)
    throw std::invalid_argument("hidden_size and intermediate_size must be positive");
  if (config_.max_chunk_tokens < 1) throw std::invalid_argument("max_chunk_tokens must be positive");
  if (runner_->num_pools() > kMaxPools) throw std::invalid_argument("at most 64 pools");
  const GluConfig& glu = config_.glu;
  if (glu.kind != GluKind::kSilu && glu.kind != GluKind::kSwigluOai)
    throw std::invalid_argument("unknown activation kind " + std::to_string(static_cast<int>(glu.kind)));
  if (!(glu.limit >= 0.0f) || !std::isfinite(glu.limit) || !std::isfinite(glu.alpha))
    throw std::invalid_argument("activation limit must be finite and >= 0 (0: none), alpha finite");
  config_.group = group_;
  const int64_t unit = std::max<int64_t>({group_, config_.down_group, kKAlign});
  hidden_padded_ = round_up(config_.hidden, unit);
  const int64_t units = round_up(config_.intermediate, unit) / unit;
  intermediate_padded_ = units * unit;
  const int P = runner_->num_pools();
  const int64_t E = config_.num_experts;
  if (!config_.absent.empty() && static_cast<int64_t>(config_.absent.size()) != E)
    throw std::invalid_argument("the mask of absent experts has " + std::to_string(config_.absent.size()) +
                                " entries; num_experts is " + std::to_string(E));
  storage_.assign(E, -1);
  for (int64_t e = 0; e < E; ++e)
    if (config_.absent.empty() || !config_.absent[e]) storage_[e] = held_++;
  for (int p = 0; p < P; ++p) {
    auto pw = std::make_unique<PoolWeights>();
    pw->node = runner_->pool(p).node;
    pw->i_begin = units * p / P * unit;
    pw->i_end = units * (p + 1) / P * unit;
    const int64_t slice = pw->i_end - pw->i_begin;
    pw->gate_region = {pw->i_begin, slice, 0, hidden_padded_};
    pw->down_region = {0, round_up(config_.hidden, kPanelWidth), pw->i_begin, slice};
    pw->gate_up_bytes = 2 * packed_matrix_bytes(config_.method, group_, pw->gate_region);
    pw->down_bytes = packed_matrix_bytes(*config_.down_method, config_.down_group, pw->down_region);
    pw->gate_up_alloc = static_cast<size_t>(pw->gate_up_bytes * held_);
    pw->down_alloc = static_cast<size_t>(pw->down_bytes * held_);
    pw->gate_up = static_cast<uint8_t*>(alloc_on_node(pw->gate_up_alloc, pw->node));
    pw->down = static_cast<uint8_t*>(alloc_on_node(pw->down_alloc, pw->node));
    pools_.push_back(std::move(pw));
  }
  while (down_bias_pool_ + 1 < P && pools_[down_bias_pool_]->i_end == pools_[down_bias_pool_]->i_begin)
    ++down_bias_pool_;
}

MoeLayer::~MoeLayer() {
  drain();
}

void MoeLayer::drain() const {
  runner_->wait_done(last_task_.load(std::memory_order_acquire));
}

int64_t MoeLayer::packed_bytes() const {
  int64_t total = 0;
  for (const auto& p : pools_) total += (p->gate_up_bytes + p->down_bytes) * held_;
  return total;
}

std::vector<std::pair<int64_t, int64_t>> MoeLayer::pool_slices() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& p : pools_) out.emplace_back(p->i_begin, p->i_end);
  return out;
}

MoeLayer::PackedSlice MoeLayer::packed_slice(int pool) const {
  const PoolWeights& pw = *pools_.at(pool);
  return {pw.i_begin, pw.i_end, pw.gate_up, pw.down, pw.gate_up_bytes, pw.down_bytes};
}

void MoeLayer::pack_expert(int slot, const CanonicalMatrix& gate, const CanonicalMatrix& up,
                           const CanonicalMatrix& down) {
  const int64_t at = storage_[slot];
  if (at < 0) return;               // held elsewhere
  const int64_t width = h_group();  // intermediate channels per interleaved block
  const int64_t panel = panel_bytes(config_.method, group_, hidden_padded_);
  for (const auto& pw : pools_) {
    uint8_t* gate_up = pw->gate_up + at * pw->gate_up_bytes;
    for (int64_t i0 = 0; i0 < pw->gate_region.rows; i0 += width) {
      const PackRegion block{pw->gate_region.row_offset + i0, width, 0, hidden_padded_};
      const int64_t npan = width / kPanelWidth;
      pack_panels(gate, block, 0, npan, gate_up);
      pack_panels(up, block, 0, npan, gate_up + npan * panel);
      gate_up += 2 * npan * panel;
    }
    const int64_t dp = pw->down_region.rows / kPanelWidth;
    if (pw->down_region.cols > 0) pack_panels(down, pw->down_region, 0, dp, pw->down + at * pw->down_bytes);
  }
}

namespace {

// Runs f; an invalid_argument it throws comes back naming the expert (and projection).
template <class F>
void with_context(int64_t expert, const char* projection, F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("expert " + std::to_string(expert) + (*projection ? " " : "") + projection +
                                ": " + e.what());
  }
}

// A canonical matrix with storage of its own.
struct OwnedCanonical {
  CanonicalMatrix m;
  std::vector<uint8_t> weight;
  std::vector<float> scales, mins;  // 4 bytes a value or group: room for every method's tables
  void reset(Method method, int64_t N, int64_t K, int group) {
    m = CanonicalMatrix{method, N, K, group};
    grow(weight, static_cast<size_t>(N * m.weight_row_bytes()));
    grow(scales, static_cast<size_t>(N * m.num_groups()));
    grow(mins, static_cast<size_t>(N * m.num_groups()));
    m.weight = weight.data(), m.scales = scales.data(), m.mins = mins.data();
  }
};

}  // namespace

void MoeLayer::load_biases(const float* gate, const float* up, const float* down) {
  drain();  // a pending forward reads the biases
  const int64_t E = config_.num_experts, I = config_.intermediate, H = config_.hidden;
  auto take = [&](const float* src, int64_t n, int64_t padded, const char* what, std::vector<float>& dst) {
    dst.clear();
    if (!src) return;
    const int64_t at = first_non_finite(src, DType::kFloat32, E * n);
    if (at >= 0) throw_non_finite(what, at / n, at % n, src[at]);
    dst.assign(static_cast<size_t>(E * padded), 0.0f);
    for (int64_t e = 0; e < E; ++e) std::copy_n(src + e * n, n, dst.data() + e * padded);
  };
  take(gate, I, intermediate_padded_, "gate bias", gate_bias_);
  take(up, I, intermediate_padded_, "up bias", up_bias_);
  take(down, H, round_up(H, kPanelWidth), "down bias", down_bias_);
}

void MoeLayer::load_dense(const void* gate, const void* up, const void* down, DType dtype,
                          int64_t source_experts, const std::vector<int64_t>& slot_to_source) {
  const int64_t E = config_.num_experts, I = config_.intermediate, H = config_.hidden;
  if (!slot_to_source.empty() && static_cast<int64_t>(slot_to_source.size()) != E)
    throw std::invalid_argument("physical_to_logical_map must have num_experts entries");
  for (int64_t s : slot_to_source)
    if (s < -1 || s >= source_experts)
      throw std::invalid_argument("physical_to_logical_map entry " + std::to_string(s) + " is outside the " +
                                  std::to_string(source_experts) + " source experts (-1: not in this call)");
  if (slot_to_source.empty() && source_experts < E)
    throw std::invalid_argument("weights hold fewer experts than num_experts");
  const int64_t elem = dtype == DType::kFloat32 ? 4 : 2;
  auto& counter = workspace_->load_counter.value;
  counter.store(0);
  runner_->run([&](const WorkerContext& ctx) {
    OwnedCanonical g, u, d;
    for_each_item(counter, E, [&](int64_t slot) {
      const int64_t src = slot_to_source.empty() ? slot : slot_to_source[slot];
      if (storage_[slot] < 0 || src < 0) return;  // held elsewhere, or loaded by another call
      g.reset(config_.method, I, H, group_);
      u.reset(config_.method, I, H, group_);
      d.reset(*config_.down_method, H, I, config_.down_group);
      with_context(src, "gate_proj", [&] {
        quantize_rows(static_cast<const char*>(gate) + src * I * H * elem, dtype, g.m, 0, I);
      });
      with_context(src, "up_proj", [&] {
        quantize_rows(static_cast<const char*>(up) + src * I * H * elem, dtype, u.m, 0, I);
      });
      with_context(src, "down_proj", [&] {
        quantize_rows(static_cast<const char*>(down) + src * H * I * elem, dtype, d.m, 0, H);
      });
      pack_expert(static_cast<int>(slot), g.m, u.m, d.m);
    });
  });
  loaded_ = true;
}

void MoeLayer::load_canonical(const std::vector<CanonicalMatrix>& gate,
                              const std::vector<CanonicalMatrix>& up,
                              const std::vector<CanonicalMatrix>& down) {
  const int64_t E = config_.num_experts, I = config_.intermediate, H = config_.hidden;
  if (static_cast<int64_t>(gate.size()) != E || static_cast<int64_t>(up.size()) != E ||
      static_cast<int64_t>(down.size()) != E)
    throw std::invalid_argument("need one canonical gate, up and down matrix per expert");
  auto check = [&](const CanonicalMatrix& m, Method method, int group, int64_t N, int64_t K,
                   const char* what) {
    if (m.method != method || m.N != N || m.K != K || m.group != group || !m.complete())
      throw std::invalid_argument(std::string(what) + ": canonical matrix does not match the layer (method " +
                                  method_traits(method).name + ", shape [" + std::to_string(N) + ", " +
                                  std::to_string(K) + "], group " + std::to_string(group) + ")");
  };
  for (int64_t e = 0; e < E; ++e) {
    if (storage_[e] < 0) continue;  // held elsewhere: its matrices are not read
    check(gate[e], config_.method, group_, I, H, "gate");
    check(up[e], config_.method, group_, I, H, "up");
    check(down[e], *config_.down_method, config_.down_group, H, I, "down");
  }
  auto& counter = workspace_->load_counter.value;
  counter.store(0);
  runner_->run([&](const WorkerContext&) {
    for_each_item(counter, E, [&](int64_t e) {
      if (storage_[e] < 0) return;
      with_context(e, "gate", [&] { check_finite(gate[e]); });
      with_context(e, "up", [&] { check_finite(up[e]); });
      with_context(e, "down", [&] { check_finite(down[e]); });
      with_context(e, "", [&] { pack_expert(static_cast<int>(e), gate[e], up[e], down[e]); });
    });
  });
  loaded_ = true;
}

void check_expert_ids(const void* ids, bool ids_int64, int64_t tokens, int top_k, int num_experts,
                      int64_t first_token) {
  auto first_bad = [&](const auto* v) -> int64_t {
    for (int64_t i = 0; i < tokens * top_k; ++i)
      if (v[i] < -1 || v[i] >= num_experts) return i;
    return -1;
  };
  const int64_t i =
      ids_int64 ? first_bad(static_cast<const int64_t*>(ids)) : first_bad(static_cast<const int32_t*>(ids));
  if (i < 0) return;
  const int64_t e = ids_int64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
  throw std::invalid_argument("topk_ids holds expert id " + std::to_string(e) + " at token " +
                              std::to_string(first_token + i / top_k) + ", slot " +
                              std::to_string(i % top_k) + ", outside [-1, " + std::to_string(num_experts) +
                              ") (-1 means skip)");
}

uint64_t MoeLayer::submit_forward(const ForwardArgs& args) {
  if (!loaded_) throw std::runtime_error("forward before the weights were loaded");
  if (!args.hidden || !args.expert_ids || !args.weights || !args.out == !args.out_f32)
    throw std::invalid_argument(
        "forward: null hidden_states, expert ids or weights, or not exactly one output");
  if (!args.tokens_ptr && args.tokens < 0) throw std::invalid_argument("forward: negative token count");
  if (!args.tokens_ptr)
    check_expert_ids(args.expert_ids, args.ids_int64, args.tokens, config_.top_k, config_.num_experts);
  ForwardArgs copy = args;
  const uint64_t id = runner_->submit([this, copy](const WorkerContext& ctx) { forward_task(copy, ctx); });
  // Submissions may come from CUDA's host-function thread and Python's: keep the largest id.
  uint64_t last = last_task_.load(std::memory_order_relaxed);
  while (last < id && !last_task_.compare_exchange_weak(last, id, std::memory_order_acq_rel)) {
  }
  return id;
}

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
  // h quantized per (row, group) (else bf16): MethodTraits::gate_up_input / down_input. The
  // bf16-input kernel also runs gate/up of the experts with many rows (ws.a16) where it is faster.
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

// Row r of expert e's h (a pool's `slice` of it), quantized to int8 per group for the down
// projection (int8_h methods).
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
  quantize_activation_row(row.data(), slice, G, false, reinterpret_cast<int8_t*>(q.data()),
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
  const int down_a16_min_rows = table_.method(*config_.down_method).down_a16_min_rows;
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
    ws.down_a16.assign(E, 0);
    bool any_a16 = false;
    for (int e = 0; e < E; ++e) {
      ws.padded_offsets[e + 1] = ws.padded_offsets[e] + round_up(ws.counts[e], kRowBlock);
      ws.a16[e] = int8_x && a16_min_rows > 0 && ws.counts[e] >= a16_min_rows;
      any_a16 = any_a16 || ws.a16[e];
      ws.down_a16[e] = int8_h && down_a16_min_rows > 0 && ws.counts[e] >= down_a16_min_rows;
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
          if (int8_h && !ws.down_a16[e])
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
      if (!ws.down_a16[e])
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
        if (int8_h && !ws.down_a16[e]) {
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
