// NVFP4 canonical tensors -> packed groups: the e2m1 codes as INT4's nibbles, 16 e4m3 scale bytes,
// then the matrix's fp32 scale (e4m3 NaN codes were refused by check_finite).
#include <cstdint>
#include <cstring>

#include "../registry.h"
#include "nvfp4.h"

namespace kt::nvfp4 {

void pack_group(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi, uint8_t* dst) {
  pack_nibbles(src, region, n0, gi, dst);
  uint8_t* s = dst + group_weight_bytes(src.method, src.group);
  for (int n = 0; n < kPanelWidth; ++n)
    s[n] = group_table_entry<uint8_t>(src, region, src.scales, n0 + n, gi);
  std::memcpy(s + kPanelWidth, src.mins, 4);  // the third tensor: global_scale [1]
}

}  // namespace kt::nvfp4
