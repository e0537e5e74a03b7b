// AMX BF16: tdpbf16ps on 32 rows x 32 channels (2 A tiles x 2 B tiles) per step; small batches go
// to the AVX-512 kernel (a tile of 16 rows would be mostly padding).
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
  thread_local AlignedVector<uint8_t> stage;
  thread_local float out[32][32];
  if (stage.size() < static_cast<size_t>(kRowBlock * K * 2)) stage.resize(kRowBlock * K * 2);
  for (int rb = 0; rb < m; rb += kRowBlock) {
    const int rows = std::min(kRowBlock, m - rb);
    const uint8_t* A = tiled_block(reinterpret_cast<const uint8_t* const*>(a.rows + rb), a.chunk_stride, rows,
                                   K * 2, stage.data());
    for (int p = 0; p < npanels; p += 2) {
      const bool two = p + 1 < npanels;
      const uint8_t* b0 = panels + p * pbytes;
      const uint8_t* b1 = two ? b0 + pbytes : b0;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kt = 0; kt < K / 32; ++kt) {
        _tile_loadd(4, A + kt * kTiledChunkStride, 64);
        _tile_loadd(5, A + kt * kTiledChunkStride + 16 * 64, 64);
        _tile_loadd(6, b0 + kt * 1024, 64);
        _tile_loadd(7, b1 + kt * 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, &out[0][0], 128);
      _tile_stored(1, &out[0][16], 128);
      _tile_stored(2, &out[16][0], 128);
      _tile_stored(3, &out[16][16], 128);
      const int width = two ? 32 : 16;
      for (int i = 0; i < rows; ++i) std::copy_n(out[i], width, c + (rb + i) * ldc + p * kPanelWidth);
    }
  }
}

}  // namespace kt::kernels::amx
