#include "routing.h"

#include <cstdint>
#include <vector>

#include "work_items.h"

namespace kt {

void route_rows(const RoutedSlots& slots, int64_t c0, int64_t Tc, int top_k, int num_experts,
                const int64_t* storage, ExpertRows& rows) {
  const int E = num_experts, K = top_k;
  auto id_at = [&](int64_t t, int j) -> int64_t {
    const int64_t i = (c0 + t) * K + j;
    return slots.ids_int64 ? static_cast<const int64_t*>(slots.expert_ids)[i]
                           : static_cast<const int32_t*>(slots.expert_ids)[i];
  };
  auto computed_here = [&](int64_t e) {
    return e >= 0 && (!storage || storage[e] >= 0) && !(slots.skip_mask && slots.skip_mask[e]);
  };
  rows.counts.assign(E, 0);
  for (int64_t t = 0; t < Tc; ++t)
    for (int j = 0; j < K; ++j) {
      const int64_t e = id_at(t, j);
      if (computed_here(e)) ++rows.counts[e];
    }
  rows.offsets.assign(E + 1, 0);
  rows.active.clear();
  for (int e = 0; e < E; ++e) {
    rows.offsets[e + 1] = rows.offsets[e] + rows.counts[e];
    if (rows.counts[e] > 0) rows.active.push_back(e);
  }
  const int64_t R = rows.offsets[E];
  grow(rows.row_token, R), grow(rows.row_expert, R), grow(rows.row_weight, R), grow(rows.slot_row, Tc * K);
  rows.fill.assign(rows.offsets.begin(), rows.offsets.end() - 1);  // no allocation per chunk
  for (int64_t t = 0; t < Tc; ++t)
    for (int j = 0; j < K; ++j) {
      const int64_t e = id_at(t, j);
      rows.slot_row[t * K + j] = -1;
      if (!computed_here(e)) continue;
      const int64_t r = rows.fill[e]++;
      rows.slot_row[t * K + j] = r;
      rows.row_token[r] = static_cast<int32_t>(t);
      rows.row_expert[r] = static_cast<int32_t>(e);
      rows.row_weight[r] = slots.weights[(c0 + t) * K + j];
    }
}

}  // namespace kt
