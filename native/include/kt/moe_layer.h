// One MoE layer's experts on the CPU: packed weights per pool and the forward task.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "kt/kernels.h"
#include "kt/quantize.h"
#include "kt/runner.h"

namespace kt {

// The gated activation between gate/up and down, after the optional biases:
//   kSilu:      h = silu(g) * u                               (Qwen, DeepSeek, Mixtral, ...)
//   kSwigluOai: h = (u + 1) * g * sigmoid(alpha * g)          (gpt-oss)
// with, when limit > 0, g = min(g, limit) and u = clamp(u, -limit, limit) first (gpt-oss, DeepSeek-V4).
enum class GluKind : int { kSilu = 0, kSwigluOai = 1 };
struct GluConfig {
  GluKind kind = GluKind::kSilu;
  float limit = 0.0f;  // 0: no clamp
  float alpha = 1.702f;
  bool plain() const { return kind == GluKind::kSilu && limit == 0.0f; }
};

struct MoeConfig {
  int num_experts = 0;
  int top_k = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  Method method = Method::kBf16;
  int group = 0;  // 0: the method's default
  // The down projection's method and group where they differ from gate/up's (a GGUF file stores
  // each tensor in its own type); unset: gate/up's.
  std::optional<Method> down_method;
  int down_group = 0;
  int64_t max_chunk_tokens = 4096;  // prefill is computed in chunks of this many tokens
  GluConfig glu;
  // [num_experts], 1: the expert is held elsewhere (a GPU slot): no packed weights here, never
  // computed here, not read at load. Empty: every expert is held.
  std::vector<uint8_t> absent;
  // Int8 inputs with one scale per row: gate/up's per token, and h (in bf16 for INT8 otherwise) per
  // row for down, from any number of rows. Weights with one scale per row over all of K (kt-kernel's
  // directories) are then computed with the numerics they were made for, and AMX sums all of K in
  // the tiles (no group epilogue, no switch to the bf16-input kernels).
  bool int8_input_per_row = false;
};

// Scratch shared by every layer on one runner (tasks run one at a time; src/forward/workspace.h).
struct MoeWorkspace;
// A read-only mapping of a packed file (moe_layer.cpp).
struct MappedFile;

struct ForwardArgs {
  int64_t tokens = 0;                   // used when tokens_ptr is null
  const int32_t* tokens_ptr = nullptr;  // read when the task runs (one captured graph, any batch)
  int64_t max_tokens = 0;               // with tokens_ptr: the buffers' capacity (0: unchecked)
  const uint16_t* hidden = nullptr;     // bf16 [tokens, hidden]
  const void* expert_ids = nullptr;     // int32 or int64 [tokens, top_k]; -1 = skip
  bool ids_int64 = false;
  const float* weights = nullptr;   // fp32 [tokens, top_k]
  const bool* skip_mask = nullptr;  // [num_experts], true = not computed here; may be null
  uint16_t* out = nullptr;          // bf16 [tokens, hidden]
  float* out_f32 = nullptr;         // instead of out: fp32 [tokens, hidden], for callers that add
                                    // other partial sums and round once (the hybrid layer)
  bool incremental = false;         // add to out instead of writing it
  uint32_t* done_flag = nullptr;    // set to 1 (release) when the task ends, its output written
};

// Throws std::invalid_argument naming the first id of `ids` [tokens, top_k] outside
// [-1, num_experts); `first_token` is the index of row 0 in the caller's batch (for the message).
void check_expert_ids(const void* ids, bool ids_int64, int64_t tokens, int top_k, int num_experts,
                      int64_t first_token = 0);

class MoeLayer {
 public:
  MoeLayer(const MoeConfig& config, std::shared_ptr<Runner> runner, std::shared_ptr<MoeWorkspace> workspace,
           Isa isa);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  const MoeConfig& config() const { return config_; }
  Isa isa() const { return table_.isa; }
  bool loaded() const { return loaded_; }

  // Dense expert weights gate/up [E_src, I, H], down [E_src, H, I] of one float dtype; slot e
  // takes source expert slot_to_source[e] (identity when empty; -1: left as it is, so that a layer
  // loads a few experts a call). Quantized and packed in parallel on the pools; blocks until done.
  void load_dense(const void* gate, const void* up, const void* down, DType dtype, int64_t source_experts,
                  const std::vector<int64_t>& slot_to_source);
  // Already-quantized canonical matrices, one per slot and projection (see quantize.h). With
  // `partial`, a held slot whose three matrices have no weights is left as it is, so that a layer
  // loads a few experts a call (every held slot must be loaded once before a forward).
  void load_canonical(const std::vector<CanonicalMatrix>& gate, const std::vector<CanonicalMatrix>& up,
                      const std::vector<CanonicalMatrix>& down, bool partial = false);
  // The packed file layout (docs/weight-format.md, "Packed layout"): each expert's packed weights as
  // one pool over the whole intermediate dimension holds them, gate/up then down. Bytes of one
  // expert's gate/up and down in it; the layout's version (bumped whenever quant_types.h's packed
  // layout or the pool slicing changes).
  static constexpr int kPackedFileVersion = 1;
  int64_t file_gate_up_bytes() const;
  int64_t file_down_bytes() const;
  // Copies held slot `slot`'s packed weights into the file layout.
  void export_packed(int slot, uint8_t* gate_up, uint8_t* down) const;
  // Takes every held slot's weights from a packed file: slot e holds the file's expert
  // slot_to_file[e] (ignored for absent slots). The file holds `file_experts` experts' gate/up
  // from byte `gate_up_offset` and their down projections from `down_offset` (both page-aligned).
  // With one pool the layer computes from the read-only mapping itself (no copy: a restart reads
  // from the page cache); with several, each pool copies its slice onto its node. The pages the
  // held experts use are read before it returns. Validates the offsets and the file's size first;
  // a layer whose weights are mapped loads nothing else.
  void map_packed(const std::string& path, int64_t gate_up_offset, int64_t down_offset, int64_t file_experts,
                  const std::vector<int64_t>& slot_to_file);
  bool mapped() const { return mapping_ != nullptr; }

  // Expert biases, fp32 and one row per slot: added to gate [E, I] and up [E, I] before the
  // activation and to the down projection's output [E, H] before the routing weight (gpt-oss).
  // Any may be null (no bias). Throws naming the tensor, row and column of a non-finite value.
  void load_biases(const float* gate, const float* up, const float* down);

  // Validates (the expert ids too when the batch size is known now), then enqueues the forward on
  // the runner and returns at once.
  uint64_t submit_forward(const ForwardArgs& args);
  // Waits until every forward this layer submitted has finished (errors stay for the runner's
  // next sync). The destructor drains, so a pending task never reads a freed layer.
  void drain() const;

  // Bytes of packed weights (all pools).
  int64_t packed_bytes() const;
  // Per pool: [i_begin, i_end) slice of the (padded) intermediate dimension.
  std::vector<std::pair<int64_t, int64_t>> pool_slices() const;

  // Read-only views for the forward plan (src/forward/) and the fine-tuning backward (lora.h): pool
  // p's slice [i_begin, i_end) of the intermediate channels, its gate/up blocks (gate_up_block()
  // channels each: that many gate rows' panels, then as many up rows') over hidden_padded() columns,
  // and its down panels (round_up(hidden, 16) rows over the slice).
  struct PackedSlice {
    int64_t i_begin = 0, i_end = 0;
    const uint8_t* gate_up = nullptr;  // expert e at gate_up + e * gate_up_bytes
    const uint8_t* down = nullptr;
    int64_t gate_up_bytes = 0, down_bytes = 0;
  };
  PackedSlice packed_slice(int pool) const;
  int num_pools() const { return static_cast<int>(pools_.size()); }
  int group() const { return group_; }
  // Gate/up's method holds for down (fine-tuning reads both projections with one method).
  bool one_method() const { return *config_.down_method == config_.method && config_.down_group == group_; }
  int64_t hidden_padded() const { return hidden_padded_; }
  int64_t intermediate_padded() const { return intermediate_padded_; }
  int64_t gate_up_block() const { return h_group(); }
  bool has_biases() const { return !gate_bias_.empty() || !up_bias_.empty() || !down_bias_.empty(); }
  // Every expert is held, slot e at storage e (what fine-tuning's kernels address).
  bool holds_every_expert() const;
  // [E]: where expert e's packed weights are among the held ones (PackedSlice), -1 when absent.
  const std::vector<int64_t>& storage() const { return storage_; }
  const KernelTable& kernels() const { return table_; }
  Runner& runner() const { return *runner_; }
  MoeWorkspace& workspace() const { return *workspace_; }
  // The biases as load_biases took them, zero-padded: gate and up [E, intermediate_padded()], down
  // [E, hidden rounded to 16]; null when absent. Pool `down_pool` adds the down bias, once per row.
  struct Biases {
    const float* gate = nullptr;
    const float* up = nullptr;
    const float* down = nullptr;
    int down_pool = 0;
  };
  Biases biases() const;

 private:
  struct PoolWeights;
  void check_not_mapped() const;
  // Pool `pw`'s slice of one expert in the packed file layout, as contiguous runs:
  // gate_up(file_offset, pool_offset, bytes) and down(file_offset, pool_offset, bytes).
  template <class G, class D>
  void for_each_file_run(const PoolWeights& pw, G&& gate_up, D&& down) const;
  void pack_expert(int slot, const CanonicalMatrix& gate, const CanonicalMatrix& up,
                   const CanonicalMatrix& down);
  // Intermediate channels per gate/up work item: the quantization group (64 for BF16), at least 32
  // (NVFP4's groups of 16 would make items of one panel).
  int64_t h_group() const { return std::max(group_, 32); }

  MoeConfig config_;
  std::shared_ptr<Runner> runner_;
  std::shared_ptr<MoeWorkspace> workspace_;
  const KernelTable& table_;
  int group_;
  int64_t hidden_padded_;  // K of gate/up, multiple of the groups and of 64
  // [E]: where expert e's packed weights are among the held ones, -1 when absent
  std::vector<int64_t> storage_;
  int64_t held_ = 0;
  std::vector<std::unique_ptr<PoolWeights>> pools_;
  std::unique_ptr<MappedFile> mapping_;  // the packed file one pool computes from (map_packed)
  // Biases as load_biases took them, zero-padded: [E, intermediate_padded_] and [E, hidden
  // rounded to 16]; empty when absent.
  std::vector<float> gate_bias_, up_bias_, down_bias_;
  int64_t intermediate_padded_ = 0;
  int down_bias_pool_ = 0;  // the first pool with a non-empty slice adds the down bias
  bool loaded_ = false;
  std::atomic<uint64_t> last_task_{0};  // the runner's id of this layer's latest forward
};

std::shared_ptr<MoeWorkspace> make_workspace();

}  // namespace kt
