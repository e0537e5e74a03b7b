// AMX BF16: tdpbf16ps on 32 rows x 32 channels (2 A tiles x 2 B tiles) per step; small batches go
// to the AVX-512 kernel (a tile of 16 rows would be mostly padding).
//
// Loop order: channel pair (2 panels) > block of 32 rows > K. A pair's panels come from DRAM once
// and are re-read from L2 by the other row blocks; the next pair is prefetched into L2 a few lines
// per step, so its DRAM stream overlaps this pair's AMX work instead of stalling the first row
// block's tile loads.
#include <algorithm>
#include <vector>

#include "kt/quant_types.h"
#include "tile_config.h"

namespace kt::kernels::amx {

void gemm_bf16(int m, int64_t K, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  if (m <= 4) return avx512::gemm_bf16(m, K, a, panels, npanels, c, ldc);
  configure_tiles();
  const int64_t pbytes = panel_bytes(Method::kBf16, kKAlign, K);
  const int64_t ksteps = K / 32;
  const int blocks = (m + kRowBlock - 1) / kRowBlock;
  thread_local AlignedVector<uint8_t> stage;  // row blocks that are not tiled yet
  thread_local std::vector<const uint8_t*> base;
  alignas(64) thread_local float out[32][32];
  if (stage.size() < static_cast<size_t>(blocks * kRowBlock * K * 2))
    stage.resize(blocks * kRowBlock * K * 2);
  base.resize(blocks);
  for (int b = 0; b < blocks; ++b) {
    const int rows = std::min(kRowBlock, m - b * kRowBlock);
    base[b] = tiled_block(reinterpret_cast<const uint8_t* const*>(a.rows + b * kRowBlock), a.chunk_stride,
                          rows, K * 2, stage.data() + b * kRowBlock * K * 2);
  }
  const int64_t steps = blocks * ksteps;  // AMX steps per pair
  for (int p = 0; p < npanels; p += 2) {
    const bool two = p + 1 < npanels;
    const uint8_t* b0 = panels + p * pbytes;
    const uint8_t* b1 = two ? b0 + pbytes : b0;
    const char* next = reinterpret_cast<const char*>(b0 + 2 * pbytes);
    const int64_t next_lines = std::clamp(npanels - p - 2, 0, 2) * pbytes / 64;
    const int64_t lines_per_step = (next_lines + steps - 1) / steps;
    int64_t line = 0;
    for (int b = 0; b < blocks; ++b) {
      const int rows = std::min(kRowBlock, m - b * kRowBlock);
      const uint8_t* A = base[b];
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kt = 0; kt < ksteps; ++kt) {
        for (int64_t end = std::min(next_lines, line + lines_per_step); line < end; ++line)
          _mm_prefetch(next + line * 64, _MM_HINT_T1);
        _tile_loadd(4, A + kt * kTiledChunkStride, 64);
        _tile_loadd(5, A + kt * kTiledChunkStride + 16 * 64, 64);
        _tile_loadd(6, b0 + kt * 1024, 64);
        _tile_loadd(7, b1 + kt * 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* cb = c + b * kRowBlock * ldc + p * kPanelWidth;
      if (rows == kRowBlock && two) {  // a full block goes straight to c
        const int64_t stride = ldc * 4;
        _tile_stored(0, cb, stride);
        _tile_stored(1, cb + 16, stride);
        _tile_stored(2, cb + 16 * ldc, stride);
        _tile_stored(3, cb + 16 * ldc + 16, stride);
        continue;
      }
      _tile_stored(0, &out[0][0], 128);
      _tile_stored(1, &out[0][16], 128);
      _tile_stored(2, &out[16][0], 128);
      _tile_stored(3, &out[16][16], 128);
      const int width = two ? 32 : 16;
      for (int i = 0; i < rows; ++i) std::copy_n(out[i], width, cb + i * ldc);
    }
  }
}

}  // namespace kt::kernels::amx
