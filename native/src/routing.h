// The forward plan's routing (forward/route.cpp), which the fine-tuning backward reads as its
// forward saved it: a chunk of tokens' (token, slot) pairs computed here, grouped by expert into rows.
#pragma once

#include <algorithm>  // std::copy, in ExpertRows' copy assignment (the fine-tuning forward keeps one)
#include <cstdint>
#include <vector>

namespace kt {

// What a forward's arguments give the routing (kt/moe_layer.h ForwardArgs).
struct RoutedSlots {
  const void* expert_ids = nullptr;  // int32 or int64 [tokens, top_k]; -1 = skip
  bool ids_int64 = false;
  const float* weights = nullptr;   // fp32 [tokens, top_k]
  const bool* skip_mask = nullptr;  // [num_experts], true = not computed here; may be null
};

// One row per (token, slot) computed here, grouped by expert, in token then slot order within each
// expert. The vectors grow and never shrink (no allocation per chunk): only the first offsets[E]
// rows and tokens * top_k slots are the chunk's.
struct ExpertRows {
  std::vector<int64_t> counts, offsets;  // [E], [E + 1]: expert e's rows are [offsets[e], offsets[e + 1])
  std::vector<int64_t> fill;             // [E]: the next free row of each expert while routing
  std::vector<int> active;               // experts with at least one row, ascending
  std::vector<int32_t> row_token;        // chunk-local token of each row
  std::vector<int32_t> row_expert;       // expert of each row
  std::vector<float> row_weight;
  std::vector<int64_t> slot_row;  // [tokens, top_k]: the row of each slot, -1 when not computed here
};

// Routes tokens [c0, c0 + Tc) of the batch: a slot is computed here when its id is an expert (not
// -1), held here (storage null, or storage[e] >= 0) and not in the skip mask. The ids must be valid
// (check_expert_ids).
void route_rows(const RoutedSlots& slots, int64_t c0, int64_t Tc, int top_k, int num_experts,
                const int64_t* storage, ExpertRows& rows);

}  // namespace kt
