// The forward plan of a MoE layer, one StepTask for both of its clients: inference (no client) and
// fine-tuning (client.h: its epilogue and save hook). Per chunk of tokens the steps are route,
// gather, the experts (gate/up, the int8 h of large chunks, down; per pool) and combine, each
// opening when every unit of the one before has returned (docs/engine.md, "One forward"). The task
// reads the layer through its public views and computes in the layer's MoeWorkspace.
//
//   task.cpp     the steps in order and their shapes
//   route.cpp    the batch size, routing, the plan of each step's units
//   gather.cpp   each token's input, quantized once, into its rows
//   experts.cpp  gate/up, h, down
//   combine.cpp  the pools' partial outputs into the output
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "forward/client.h"
#include "forward/workspace.h"
#include "kt/kernels.h"
#include "kt/moe_layer.h"
#include "kt/runner.h"

namespace kt {

class ForwardTask final : public StepTask {
 public:
  // The client may be null (inference).
  ForwardTask(const MoeLayer& layer, const ForwardArgs& args, std::shared_ptr<ForwardClient> client);
  bool next_step(StepShape& shape) override;
  void run_unit(int64_t unit, const WorkerContext& ctx) override;

 private:
  enum class Step { kNone, kStart, kRoute, kGather, kExperts, kCombine };

  // The open chunk: its tokens, the layer's sizes and what the method's kernels read.
  struct Chunk {
    int64_t c0 = 0, Tc = 0;  // tokens [c0, c0 + Tc) of the batch
    int64_t max_tokens;      // a chunk's: the layer's max_chunk_tokens; a client's batch is one chunk
    int E, K, P, G, Gd;      // experts, top-k, pools, quantization groups of gate/up and down
    int64_t H, Hp, Hy, Gh;   // hidden size, padded to the group and to 16; intermediate block
    // Gate/up read int8 inputs quantized per (token, group) (else bf16), the down projection an
    // int8 h quantized per (row, group) or per row (ws.h_per_row; else bf16):
    // MethodTraits::gate_up_input / down_input, never with a client. The bf16-input kernel also
    // runs gate/up of the experts with many rows (ws.a16) where it is faster.
    bool int8_x, int8_h;
    GemmQ8Fn gemm_q, down_q;  // gate/up's kernels, down's
    GemmA16Fn gemm_a16, down_a16;
  };

  // How the open chunk's steps are cut into units: set when the chunk is routed.
  struct Plan {
    int64_t max_rows = 0;                          // rows of the longest kernel call
    int64_t tokens_per_unit = 1, token_units = 0;  // gather, combine: runs of tokens, four per worker
    int64_t client_units = 0;                      // the client's units of the gather step
    int64_t h_blocks = 0;                          // gate/up blocks of an expert over every pool (ws.h_done)
    struct Pool {
      int64_t slice = 0;  // the pool's intermediate channels
      int64_t per_item = 1, items_per_expert = 0, blocks_per_call = 1, gate_up_items = 0;  // gate/up
      int64_t experts_units = 0;         // the experts step: gate/up items, [int8 h blocks,] down units
      int64_t quantize_h_units = 0;      // large chunks of int8_h methods: one per block of 32 rows
      std::vector<int64_t> down_starts;  // down_rows: each down range's first (expert, panel), then the end
      int64_t down_per_item = 0, down_units = 0;  // large chunks: output panels per item; either: units
    };
    std::vector<Pool> pools;
    int64_t splits = 1, width = 0, combine_units = 0;  // combine: column splits per token, their width
  };

  bool advance(StepShape& shape);  // the next step's shape; false when the task is done

  // route.cpp
  bool start();       // reads the batch size, routes the first chunk; false: nothing to do
  void route();       // sets ws.bad_routing on failure
  void plan_steps();  // plan_ for the routed chunk
  // gather.cpp
  void gather_unit(int64_t unit);
  void gather_tokens(int64_t t0, int64_t t1);
  // experts.cpp
  void experts_unit(int64_t unit, const WorkerContext& ctx);
  void gate_up_item(const WorkerContext& ctx, int64_t item);
  void quantize_h_unit(const WorkerContext& ctx, int64_t block);
  void down_unit(const WorkerContext& ctx, int64_t unit);
  // combine.cpp
  void combine_item(int64_t unit);

  const MoeLayer& layer_;
  MoeWorkspace& ws_;
  const KernelTable& table_;
  const MoeLayer::Biases biases_;
  const ForwardArgs args_;
  const std::shared_ptr<ForwardClient> client_;
  Chunk chunk_;
  Plan plan_;
  Step step_ = Step::kNone;
  bool started_ = false;
};

}  // namespace kt
