#include "kt/packing.h"

#include <cstdint>
#include <cstring>

#include "methods/registry.h"

namespace kt {

int64_t packed_matrix_bytes(Method method, int group, const PackRegion& region) {
  return region.rows / kPanelWidth * panel_bytes(method, group, region.cols);
}

namespace {

// Source value q (int8 / nibble) or bf16 bits at packed (row, col), zero outside the source.
struct SourceView {
  const CanonicalMatrix& m;
  const PackRegion& r;
  const int64_t row_bytes = m.weight_row_bytes();
  bool inside(int64_t row, int64_t col) const { return r.row_offset + row < m.N && r.col_offset + col < m.K; }
  const uint8_t* row_ptr(int64_t row) const {
    return static_cast<const uint8_t*>(m.weight) + (r.row_offset + row) * row_bytes;
  }
  uint16_t bf16(int64_t row, int64_t col) const {
    if (!inside(row, col)) return 0;
    return reinterpret_cast<const uint16_t*>(row_ptr(row))[r.col_offset + col];
  }
  uint8_t int8_as_u8(int64_t row, int64_t col) const {
    const int8_t q = inside(row, col) ? static_cast<int8_t>(row_ptr(row)[r.col_offset + col]) : 0;
    return static_cast<uint8_t>(q + 128);
  }
  uint8_t nibble(int64_t row, int64_t col) const {
    if (!inside(row, col)) return 0;
    const int64_t c = r.col_offset + col;
    const uint8_t b = row_ptr(row)[c / 2];
    return c % 2 == 0 ? (b & 0x0f) : (b >> 4);
  }
};

}  // namespace

void pack_group_bf16(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                     uint8_t* dst) {
  const SourceView v{src, region};
  const int64_t k0 = gi * kKAlign;
  auto* d = reinterpret_cast<uint16_t*>(dst);
  for (int r = 0; r < kKAlign / 2; ++r)
    for (int n = 0; n < kPanelWidth; ++n)
      for (int j = 0; j < 2; ++j) d[(r * kPanelWidth + n) * 2 + j] = v.bf16(n0 + n, k0 + 2 * r + j);
}

void pack_group_int8(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                     uint8_t* dst) {
  const SourceView v{src, region};
  const int group = src.group;
  const int64_t k0 = gi * group;
  for (int r = 0; r < group / 4; ++r)
    for (int n = 0; n < kPanelWidth; ++n)
      for (int j = 0; j < 4; ++j) dst[(r * kPanelWidth + n) * 4 + j] = v.int8_as_u8(n0 + n, k0 + 4 * r + j);
  auto* s = reinterpret_cast<uint16_t*>(dst + group_weight_bytes(src.method, group));
  for (int n = 0; n < kPanelWidth; ++n)
    s[n] = group_table_entry<uint16_t>(src, region, src.scales, n0 + n, gi);
}

void pack_nibbles(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                  uint8_t* dst) {
  const SourceView v{src, region};
  const int group = src.group;
  const int64_t k0 = gi * group;
  const int half = group / 8;  // rows of 4 K-values in each nibble half
  for (int r = 0; r < half; ++r)
    for (int n = 0; n < kPanelWidth; ++n)
      for (int j = 0; j < 4; ++j) {
        const uint8_t lo = v.nibble(n0 + n, k0 + 4 * r + j);
        const uint8_t hi = v.nibble(n0 + n, k0 + 4 * (r + half) + j);
        dst[(r * kPanelWidth + n) * 4 + j] = static_cast<uint8_t>(lo | (hi << 4));
      }
}

void pack_group_int4(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                     uint8_t* dst) {
  pack_nibbles(src, region, n0, gi, dst);
  auto* s = reinterpret_cast<uint16_t*>(dst + group_weight_bytes(src.method, src.group));
  for (int n = 0; n < kPanelWidth; ++n) {
    s[n] = group_table_entry<uint16_t>(src, region, src.scales, n0 + n, gi);
    s[kPanelWidth + n] = group_table_entry<uint16_t>(src, region, src.mins, n0 + n, gi);
  }
}

void pack_panels(const CanonicalMatrix& src, const PackRegion& region, int64_t panel_begin, int64_t panel_end,
                 uint8_t* out) {
  const int group = src.group;
  const int64_t groups = region.cols / group;
  const int64_t gbytes = group_bytes(src.method, group);
  const int64_t pbytes = panel_bytes(src.method, group, region.cols);
  const auto pack_group = method_ops(src.method).pack_group;
  for (int64_t p = panel_begin; p < panel_end; ++p)
    for (int64_t gi = 0; gi < groups; ++gi)
      pack_group(src, region, p * kPanelWidth, gi, out + p * pbytes + gi * gbytes);
}

}  // namespace kt
