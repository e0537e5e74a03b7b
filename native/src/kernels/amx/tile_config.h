// AMX tile configuration shared by the AMX kernels: 8 tiles of 16 rows x 64 bytes.
// ref: Intel SDM Vol. 1, 18.2 (tile configuration), Intel Intrinsics Guide (_tile_*)
//
// The kernels are built twice: for the tile unit (namespace amx) and, with KT_AMX_MODEL, against
// its software model (namespace amx_emu, the "amx-emu" ISA), which takes over the _tile_*
// intrinsics.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../avx512/lanes.h"
#include "kt/aligned_vector.h"
#include "kt/kernels.h"
#include "kt/thread_scratch.h"

#ifdef KT_AMX_MODEL
#include "tile_model.h"
#define KT_AMX_NAMESPACE amx_emu
#else
#define KT_AMX_NAMESPACE amx
#endif

namespace kt::kernels::KT_AMX_NAMESPACE {

// The AVX-512 lanes as a type of this family's own: a decoder's scales instantiated here are then
// never the same function as the AVX-512 files' (built with other flags).
struct Lanes : avx512::Lanes {};

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3 accumulate C, 4-5 hold A (rows of activations), 6-7 hold B (panels of weights);
// `k_bytes` bytes of K per dot product (64, or 32 for int8 groups of 32: A tiles of 32 bytes a row,
// B tiles of 8 rows).
inline void configure_tiles(int k_bytes = 64) {
  // Loading the configuration also zeroes the tiles; a few dozen cycles per kernel call.
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) cfg.colsb[t] = static_cast<uint16_t>(k_bytes);
  for (int t = 6; t < 8; ++t) cfg.rows[t] = static_cast<uint8_t>(k_bytes / 4);
  _tile_loadconfig(&cfg);
}

// The base of a block of up to 32 activation rows in the tiled layout (kt/kernels.h): the rows
// themselves when they already are one, else a copy in `stage` (32 * K bytes, missing rows zero).
// Chunk c of row i is then at base + c * kTiledChunkStride + i * 64.
inline const uint8_t* tiled_block(const uint8_t* const* rows, int64_t chunk_stride, int nrows,
                                  int64_t row_bytes, uint8_t* stage) {
  bool tiled = chunk_stride == kTiledChunkStride;
  for (int i = 1; i < nrows && tiled; ++i) tiled = rows[i] == rows[0] + i * kChunkBytes;
  if (tiled) return rows[0];
  const int64_t chunks = row_bytes / kChunkBytes;
  for (int i = 0; i < kRowBlock; ++i)
    for (int64_t c = 0; c < chunks; ++c) {
      uint8_t* dst = stage + c * kTiledChunkStride + i * kChunkBytes;
      if (i < nrows)
        std::memcpy(dst, rows[i] + c * chunk_stride, kChunkBytes);
      else
        std::memset(dst, 0, kChunkBytes);
    }
  return stage;
}

}  // namespace kt::kernels::KT_AMX_NAMESPACE
