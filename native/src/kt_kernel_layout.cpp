#include "kt/kt_kernel_layout.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kt {

void check_kt_kernel_tiles(const KtKernelTiles& t) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument("kt-kernel matrix of " + std::to_string(t.rows) + " rows x " +
                                std::to_string(t.row_bytes) + " bytes: " + why);
  };
  if (t.rows <= 0 || t.row_bytes <= 0) fail("empty");
  if (t.rows % 32 != 0) fail("rows must be a multiple of 32");
  if (t.row_bytes % 64 != 0) fail("row bytes must be a multiple of 64");
  if (t.row_block <= 0 || t.row_block % 32 != 0) fail("the row block must be a positive multiple of 32");
  if (t.k_block_bytes <= 0 || t.k_block_bytes % 64 != 0)
    fail("the K block must be a positive multiple of 64 bytes");
}

namespace {

// One 64-byte row of a step of INT4: kt-kernel's nibbles (j low, j + 64 high, signed) -> the
// canonical bytes (2m low, 2m + 1 high, q + 8; adding 8 to a signed nibble flips its top bit).
inline void int4_step(const uint8_t* in, uint8_t* out) {
  for (int m = 0; m < 32; ++m) {
    const uint8_t even = in[2 * m], odd = in[2 * m + 1];
    out[m] = static_cast<uint8_t>(((even & 0x0F) | (odd << 4)) ^ 0x88);
    out[32 + m] = static_cast<uint8_t>(((even >> 4) | (odd & 0xF0)) ^ 0x88);
  }
}

}  // namespace

void read_kt_kernel_tiles(const KtKernelTiles& t, const uint8_t* src, uint8_t* dst) {
  check_kt_kernel_tiles(t);
  const int64_t kb = t.row_bytes;
  alignas(64) uint8_t row[64];
  for (int64_t n0 = 0; n0 < t.rows; n0 += t.row_block) {
    const int64_t rows = std::min(t.row_block, t.rows - n0);
    const uint8_t* block = src + n0 * kb;
    for (int64_t k0 = 0; k0 < kb; k0 += t.k_block_bytes) {
      const int64_t width = std::min(t.k_block_bytes, kb - k0);
      const uint8_t* kblock = block + k0 * rows;
      for (int64_t r0 = 0; r0 < rows; r0 += 32) {
        for (int64_t c0 = 0; c0 < width; c0 += 64) {
          const uint8_t* tile = kblock + r0 * width + c0 * 32;  // 32 rows x 64 bytes
          for (int i = 0; i < 32; ++i) {
            const uint8_t* half = tile + (i / 16) * 1024 + (i % 16) * 4;
            for (int w = 0; w < 16; ++w) std::memcpy(row + 4 * w, half + w * 64, 4);
            uint8_t* out = dst + (n0 + r0 + i) * kb + k0 + c0;
            if (t.int4)
              int4_step(row, out);
            else
              std::memcpy(out, row, 64);
          }
        }
      }
    }
  }
}

}  // namespace kt
