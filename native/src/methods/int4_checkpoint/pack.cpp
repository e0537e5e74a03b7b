// RAWINT4 / GPTQ_INT4 canonical tensors -> packed groups: INT4's nibbles, then the scale block.
#include <cstdint>

#include "../registry.h"
#include "int4_checkpoint.h"

namespace kt::int4_checkpoint {

void pack_group_rawint4(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                        uint8_t* dst) {
  pack_nibbles(src, region, n0, gi, dst);
  auto* s = reinterpret_cast<uint16_t*>(dst + group_weight_bytes(src.method, src.group));
  for (int n = 0; n < kPanelWidth; ++n)
    s[n] = group_table_entry<uint16_t>(src, region, src.scales, n0 + n, gi);
}

void pack_group_gptq(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                     uint8_t* dst) {
  pack_nibbles(src, region, n0, gi, dst);
  auto* s = reinterpret_cast<uint16_t*>(dst + group_weight_bytes(src.method, src.group));
  for (int n = 0; n < kPanelWidth; ++n) {
    s[n] = group_table_entry<uint16_t>(src, region, src.scales, n0 + n, gi);
    const uint8_t zero = group_table_entry<uint8_t>(src, region, src.mins, n0 + n, gi);
    s[kPanelWidth + n] = float_to_fp16(-static_cast<float>(zero));  // exact: |zero| <= 255
  }
}

}  // namespace kt::int4_checkpoint
