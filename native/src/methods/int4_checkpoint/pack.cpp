// RAWINT4 / GPTQ_INT4 canonical tensors -> packed groups: INT4's nibbles, then the scale block.
#include "../registry.h"
#include "int4_checkpoint.h"

namespace kt::int4_checkpoint {

namespace {

// Entry of a [N, groups] table for packed row `row` and packed group `gi`; `fallback` outside.
template <typename T>
T table_entry(const CanonicalMatrix& m, const PackRegion& region, const void* table, int64_t row, int64_t gi,
              T fallback) {
  const int64_t src_row = region.row_offset + row, src_group = region.col_offset / m.group + gi;
  if (src_row >= m.N || src_group >= m.num_groups()) return fallback;
  return static_cast<const T*>(table)[src_row * m.num_groups() + src_group];
}

}  // namespace

void pack_group_rawint4(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                        uint8_t* dst) {
  pack_nibbles(src, region, n0, gi, dst);
  auto* s = reinterpret_cast<uint16_t*>(dst + group_weight_bytes(src.method, src.group));
  for (int n = 0; n < kPanelWidth; ++n) s[n] = table_entry<uint16_t>(src, region, src.scales, n0 + n, gi, 0);
}

void pack_group_gptq(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                     uint8_t* dst) {
  pack_nibbles(src, region, n0, gi, dst);
  auto* s = reinterpret_cast<uint16_t*>(dst + group_weight_bytes(src.method, src.group));
  for (int n = 0; n < kPanelWidth; ++n) {
    s[n] = table_entry<uint16_t>(src, region, src.scales, n0 + n, gi, 0);
    const uint8_t zero = table_entry<uint8_t>(src, region, src.mins, n0 + n, gi, 0);
    s[kPanelWidth + n] = float_to_fp16(-static_cast<float>(zero));  // exact: |zero| <= 255
  }
}

}  // namespace kt::int4_checkpoint
