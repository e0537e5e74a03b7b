// FP8's canonical tensors -> packed groups, e4m3 conversions, and quantization of dense matrices.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "fp8.h"

namespace kt::fp8 {

uint8_t float_to_e4m3(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::min(std::fabs(x), 448.0f);
  if (a < 0x1p-6f)  // subnormal codes 0..7 (and 8, the smallest normal) count steps of 2^-9
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(a * 0x1p9f)));
  // Normal: keep 3 of fp32's 23 mantissa bits, rounding half to even; a carry moves into the
  // exponent as it should. Exponent bias 127 -> 7.
  uint32_t bits;
  std::memcpy(&bits, &a, 4);
  bits += 0x7ffff + ((bits >> 20) & 1);
  return static_cast<uint8_t>(sign | ((bits >> 20) - ((127 - 7) << 3)));
}

namespace {

// The scale of source row `row`, source column `col` (both inside the source).
float scale_at(const CanonicalMatrix& m, int64_t row, int64_t col) {
  const auto* s = static_cast<const float*>(m.scales);
  if (m.method == Method::kFp8PerChannel) return s[row];
  const int64_t col_blocks = (m.K + kBlock - 1) / kBlock;
  return s[row / kBlock * col_blocks + col / kBlock];
}

}  // namespace

void pack_group(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi, uint8_t* dst) {
  const auto* w = static_cast<const uint8_t*>(src.weight);
  const int64_t k0 = gi * kBlock;
  for (int r = 0; r < kBlock / 2; ++r)
    for (int n = 0; n < kPanelWidth; ++n)
      for (int j = 0; j < 2; ++j) {
        const int64_t row = region.row_offset + n0 + n, col = region.col_offset + k0 + 2 * r + j;
        uint8_t b = 0;
        if (row < src.N && col < src.K) {
          b = w[row * src.K + col];
          if (e4m3_is_nan(b))
            throw std::invalid_argument("FP8 weight is NaN at row " + std::to_string(row) + ", column " +
                                        std::to_string(col));
        }
        dst[packed_offset(r, n, j)] = b;
      }
  auto* s = reinterpret_cast<float*>(dst + group_weight_bytes(src.method, kBlock));
  for (int n = 0; n < kPanelWidth; ++n) {
    const int64_t row = region.row_offset + n0 + n, col = region.col_offset + k0;
    s[n] = row < src.N && col < src.K ? scale_at(src, row, col) : 0.0f;
  }
}

void quantize_rows(const void* src, DType dtype, CanonicalMatrix& dst, int64_t row_begin, int64_t row_end) {
  const bool per_row = dst.method == Method::kFp8PerChannel;
  const int64_t K = dst.K, rows_per_block = per_row ? 1 : kBlock;
  if (row_begin % rows_per_block != 0 || (row_end % rows_per_block != 0 && row_end != dst.N))
    throw std::invalid_argument("FP8 quantize: rows must cover whole 128-row blocks");
  const int64_t cols = per_row ? K : kBlock, col_blocks = (K + cols - 1) / cols;
  std::vector<float> block;
  auto* q = static_cast<uint8_t*>(dst.weight);
  auto* scales = static_cast<float*>(dst.scales);
  const int64_t elem = dtype == DType::kFloat32 ? 4 : 2;
  for (int64_t r0 = row_begin; r0 < row_end; r0 += rows_per_block) {
    const int64_t nr = std::min(rows_per_block, dst.N - r0);
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t c0 = cb * cols, nc = std::min(cols, K - c0);
      block.resize(static_cast<size_t>(nr * nc));
      float amax = 0.0f;
      for (int64_t r = 0; r < nr; ++r) {
        const void* row = static_cast<const char*>(src) + ((r0 + r) * K + c0) * elem;
        load_checked_row(row, dtype, nc, r0 + r, c0, block.data() + r * nc);
        for (int64_t c = 0; c < nc; ++c) amax = std::max(amax, std::fabs(block[r * nc + c]));
      }
      const float scale = amax / 448.0f, inv = amax > 0.0f ? 448.0f / amax : 0.0f;
      scales[per_row ? r0 : r0 / kBlock * col_blocks + cb] = scale;
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t c = 0; c < nc; ++c) q[(r0 + r) * K + c0 + c] = float_to_e4m3(block[r * nc + c] * inv);
    }
  }
}

}  // namespace kt::fp8
