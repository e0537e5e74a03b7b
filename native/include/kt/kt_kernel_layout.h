// kt-kernel 0.7.x's packed expert matrices (its AMX BufferB, as its converted directories store them),
// read into the engine's canonical row-major bytes. kt_sglang/weights/kt_kernel_files.py describes
// the layout.
#pragma once

#include <cstdint>

namespace kt {

// The tile order of one matrix: rows in blocks of `row_block`, bytes of K in blocks of
// `k_block_bytes`, within those 32-row x 64-byte tiles whose 16-row halves hold 16 x 16 four-byte
// words transposed. `int4`: two values a byte, value j of a 128-value step in the low nibble and j + 64
// in the high one, signed (the canonical AMXINT4 byte holds values 2m and 2m + 1 as q + 8).
struct KtKernelTiles {
  int64_t rows = 0;
  int64_t row_bytes = 0;  // K for INT8, K / 2 for INT4
  int64_t row_block = 0;
  int64_t k_block_bytes = 0;
  bool int4 = false;
};

// Throws std::invalid_argument when the shape is not one kt-kernel writes (rows a multiple of 32,
// row bytes of 64, blocks of those).
void check_kt_kernel_tiles(const KtKernelTiles& t);

// `src`: rows * row_bytes bytes in kt-kernel's order; `dst`: as many, row-major canonical bytes.
void read_kt_kernel_tiles(const KtKernelTiles& t, const uint8_t* src, uint8_t* dst);

}  // namespace kt
