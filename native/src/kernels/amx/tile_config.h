// AMX tile configuration shared by the AMX kernels: 8 tiles of 16 rows x 64 bytes.
// ref: Intel SDM Vol. 1, 18.2 (tile configuration), Intel Intrinsics Guide (_tile_*)
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kt::kernels::amx {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3 accumulate C, 4-5 hold A (rows of activations), 6-7 hold B (panels of weights).
inline void configure_tiles() {
  // Loading the configuration also zeroes the tiles; a few dozen cycles per kernel call.
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// Rows a[0..rows) as one strided matrix: the rows themselves when evenly spaced, else a copy in
// `stage` (zero-filled to 32 rows). Returns the base and sets `stride` (bytes).
inline const uint8_t* strided_rows(const uint8_t* const* a, int rows, int64_t row_bytes,
                                   uint8_t* stage, int64_t& stride) {
  if (rows == 32) {
    const int64_t s = a[1] - a[0];
    bool even = s >= row_bytes;
    for (int i = 2; i < rows && even; ++i) even = a[i] - a[i - 1] == s;
    if (even) {
      stride = s;
      return a[0];
    }
  }
  for (int i = 0; i < 32; ++i) {
    if (i < rows)
      std::memcpy(stage + i * row_bytes, a[i], row_bytes);
    else
      std::memset(stage + i * row_bytes, 0, row_bytes);
  }
  stride = row_bytes;
  return stage;
}

}  // namespace kt::kernels::amx
