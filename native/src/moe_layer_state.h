// What the layer's two files share (moe_layer.cpp: construction and loading; moe_forward.cpp: the
// forward task): the per-pool packed weights and the forward's workspace.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kt/aligned_vector.h"
#include "kt/moe_layer.h"
#include "kt/packing.h"
#include "kt/topology.h"
#include "routing.h"
#include "work_items.h"

namespace kt {

constexpr int kMaxPools = 64;

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
    std::vector<float> y;  // fp32 partial output [tokens, hidden padded to 16] (down_rows: [rows, ...])
    // down_rows chunks, per active expert: its gate/up blocks done, plus one once its h is complete
    // (int8_h: quantized). An expert's down runs start on that, not on a barrier after all of gate/up.
    std::unique_ptr<std::atomic<int64_t>[]> ready;
    size_t ready_size = 0;
    // Large chunks: gate/up items and int8 h blocks done (the experts step's stages).
    std::unique_ptr<std::atomic<int64_t>[]> stage_done = std::make_unique<std::atomic<int64_t>[]>(2);
  };
  std::vector<PoolScratch> pools;
  // Small chunks (kMaxDownRowsTokens): each pool's y holds every row's down projection, summed per
  // token in slot order in phase 4, whichever worker computed it (the result is reproducible).
  bool down_rows = false;
  std::atomic<bool> failed{false};  // a worker failed in this chunk: whoever waits on ready stops
  PaddedCounter load_counter;
};

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
  bool mapped = false;  // gate_up and down point into the layer's MappedFile
  ~PoolWeights() { release(); }
  void release() {
    if (!mapped) free_on_node(gate_up, gate_up_alloc), free_on_node(down, down_alloc);
    gate_up = down = nullptr;
  }
};

struct MappedFile {
  void* base = nullptr;
  size_t bytes = 0;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(void* b, size_t n) : base(b), bytes(n) {}
  ~MappedFile();
  const uint8_t* at(int64_t offset) const { return static_cast<const uint8_t*>(base) + offset; }
};

}  // namespace kt
