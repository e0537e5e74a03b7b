// MXFP4 canonical tensors -> packed groups: the e2m1 codes as INT4's nibbles, then 16 e8m0 bytes
// (255, e8m0's NaN, was refused by check_finite).
#include <cstdint>

#include "../registry.h"
#include "mxfp4.h"

namespace kt::mxfp4 {

void pack_group(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi, uint8_t* dst) {
  pack_nibbles(src, region, n0, gi, dst);
  uint8_t* s = dst + group_weight_bytes(src.method, src.group);
  for (int n = 0; n < kPanelWidth; ++n)
    s[n] = group_table_entry<uint8_t>(src, region, src.scales, n0 + n, gi);
}

}  // namespace kt::mxfp4
