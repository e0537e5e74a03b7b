// How the forward's steps (forward.h) lay out a chunk's rows: the tiled buffers the kernels read
// (blocks of 32 rows, 64-byte K chunks: AMX loads them as tiles without copies), the rows of one
// kernel call, and the sizes that decide a chunk's mode.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "forward/workspace.h"
#include "kt/kernels.h"

namespace kt {

constexpr int kRowChunk = 512;  // rows per kernel call: bounds per-thread scratch
// Chunks of at most this many tokens keep each row's down projection apart (ws.down_rows), so that
// down items can be long runs of one expert's weights, at most kMaxRunPanels x 16 channels.
constexpr int64_t kMaxDownRowsTokens = 32;
constexpr int64_t kMaxRunPanels = 128;

// Rows per kernel call for an expert with `rows` rows: at most kRowChunk, split evenly in whole
// blocks. Each call streams (A16: dequantizes) all of the expert's weights, so a split of 256 + a
// few rows paid that twice for a few rows (DeepSeek at 2048 tokens: half the experts).
inline int64_t rows_per_call(int64_t rows) {
  const int64_t calls = (rows + kRowChunk - 1) / kRowChunk;
  return std::min<int64_t>(kRowChunk, round_up((rows + calls - 1) / calls, kRowBlock));
}

// Address of row `r` (a padded row index) in a tiled buffer whose rows hold `row_bytes`.
inline uint8_t* tiled_row(uint8_t* base, int64_t r, int64_t row_bytes) {
  return base + (r / kRowBlock) * kRowBlock * row_bytes + (r % kRowBlock) * kChunkBytes;
}

// Writes `n` bytes at byte offset `offset` of a tiled row; both are whole 64-byte chunks (rows are
// padded to 64 K-values, h blocks are groups). Copies of a constant 64 bytes: with a length known
// only at run time, GCC inlined an 8-byte loop that took 7% of a BF16 prefill.
inline void store_tiled(uint8_t* row, int64_t offset, const void* src, int64_t n) {
  const auto* s = static_cast<const uint8_t*>(src);
  uint8_t* dst = row + offset / kChunkBytes * kTiledChunkStride;
  for (int64_t c = 0; c < n / kChunkBytes; ++c)
    std::memcpy(dst + c * kTiledChunkStride, s + c * kChunkBytes, kChunkBytes);
}

// Row r of expert e sits at padded row r + padding_before(ws, e) of the gathered buffers.
inline int64_t padding_before(const MoeWorkspace& ws, int e) {
  return ws.padded_offsets[e] - ws.offsets[e];
}

}  // namespace kt
