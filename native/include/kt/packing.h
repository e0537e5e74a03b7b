// Canonical matrices -> the packed panel layout of quant_types.h, one pool's slice at a time.
#pragma once

#include <cstdint>

#include "kt/quantize.h"

namespace kt {

// Which part of a canonical matrix a packed matrix holds: packed row r is source row
// `row_offset + r`, packed column k is source column `col_offset + k`; anything past the source is
// zero. `rows` is a multiple of 16, `cols` a multiple of the group, `col_offset` of the group too.
struct PackRegion {
  int64_t row_offset = 0, rows = 0;
  int64_t col_offset = 0, cols = 0;
};

int64_t packed_matrix_bytes(Method method, int group, const PackRegion& region);

// Packs panels [panel_begin, panel_end) of `region` into `out` (the start of the packed matrix).
void pack_panels(const CanonicalMatrix& src, const PackRegion& region, int64_t panel_begin, int64_t panel_end,
                 uint8_t* out);

}  // namespace kt
