// The forward plan's scratch (forward.h), shared by every layer on one runner: tasks run one at a
// time. Grows, never shrinks.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kt/aligned_vector.h"
#include "routing.h"
#include "work_items.h"

namespace kt {

// The routing of the current chunk is its ExpertRows (routing.h).
struct MoeWorkspace : ExpertRows {
  int64_t tokens = 0;  // the batch's
  // [E + 1]: each expert's rows start a new block of 32 in the gathered buffers, so AMX reads them
  // as tiles.
  std::vector<int64_t> padded_offsets;
  bool bad_routing = false;  // set by the chunk's route unit, read when its next step opens
  // Per token: int8 input + scales (quantized methods).
  std::vector<int8_t> x_q;
  std::vector<float> x_scale, x_sum;
  // Per row, gathered in the tiled layout: the input (int8 or bf16); for experts whose gate/up runs
  // the A16 kernel (a16[e]), bf16 in x_rows16 instead, at the same padded rows.
  AlignedVector<uint8_t> x_rows, x_rows16;
  std::vector<char> a16;  // [E]
  // int8_h methods: experts whose h is quantized with one scale per row of a pool's slice
  // (MethodKernels::down_h_per_row_min_rows), the others' per group.
  std::vector<char> h_per_row;  // [E]
  struct PoolScratch {
    AlignedVector<uint8_t> h_rows;  // per row, tiled: the bf16 intermediate (every method)
    // int8_h methods: h per row quantized to int8 (tiled, same padded rows), scales and sums per group
    AlignedVector<uint8_t> h_q;
    std::vector<float> h_scale, h_sum;
    // fp32 partial output [tokens, hidden padded to 16] (down_rows: [padded rows, ...])
    std::vector<float> y;
    // down_rows chunks, per active expert: its gate/up blocks done, plus one once its h is complete
    // (int8_h: quantized). An expert's down runs start on that, not on a barrier after all of gate/up.
    std::unique_ptr<std::atomic<int64_t>[]> ready;
    size_t ready_size = 0;
    // Large chunks: gate/up items and int8 h blocks done (the experts step's stages).
    std::unique_ptr<std::atomic<int64_t>[]> stage_done = std::make_unique<std::atomic<int64_t>[]>(2);
  };
  std::vector<PoolScratch> pools;
  // With a client (client.h), per active expert: its gate/up blocks done over every pool, plus one
  // once the client has seen its whole h (ForwardClient::expert_h_done).
  std::unique_ptr<std::atomic<int64_t>[]> h_done;
  size_t h_done_size = 0;
  // Small chunks (kMaxDownRowsTokens) and a client's: each pool's y holds every row's down
  // projection, summed per token in slot order by combine, whichever worker computed it (the result
  // is reproducible).
  bool down_rows = false;
  std::atomic<bool> failed{false};  // a worker failed in this chunk: whoever waits on ready stops
  PaddedCounter load_counter;       // the layer's loading tasks' work items
};

}  // namespace kt
