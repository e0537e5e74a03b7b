// AMX BF16: tdpbf16ps on 32 rows x 32 channels (2 A tiles x 2 B tiles) per step; small batches go
// to the AVX-512 kernel (a tile of 16 rows would be mostly padding).
//
// Loop order: K-chunk > channel pair (2 panels) > block of 32 rows > K within the chunk. A chunk of
// the activations (all rows) stays in L2 for every pair; without chunks, a DeepSeek-sized call
// (256 rows x 7168) re-read 3.6 MB from L3 per pair. A pair's panels come from DRAM once per chunk
// and are re-read from L2 by the other row blocks; the next pair is prefetched into L2 a few lines
// per step, so its DRAM stream overlaps this pair's AMX work instead of stalling the first row
// block's tile loads. Sums of full row blocks live in c between chunks; the others in `acc`.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "../../kernels/amx/tile_config.h"
#include "kt/quant_types.h"

namespace kt::kernels::KT_AMX_NAMESPACE {

namespace {

// Activation bytes per K-chunk: a quarter of SPR's 2 MiB L2, leaving room for C, the pair's panels
// and the next pair's prefetch (DeepSeek gate/up, 256 rows x 7168: 1.3-1.5x over no chunks; 512 KiB
// and 256 KiB ran ~4% ahead of 1 MiB).
constexpr int64_t kChunkABytes = 512 << 10;

// K-values per chunk: equal chunks of whole 32-value steps, each within kChunkABytes of activations.
int64_t chunk_k(int blocks, int64_t K) {
  const int64_t row_block_bytes = int64_t{kRowBlock} * 2 * K * blocks;
  const int64_t chunks = std::max<int64_t>(1, (row_block_bytes + kChunkABytes - 1) / kChunkABytes);
  return round_up((K + chunks - 1) / chunks, 32);
}

// Spreads prefetches of the B lines the loop reads next over the AMX steps of the current pair, so
// their DRAM stream overlaps this pair's work: `panels` panels of `lines` lines each, `pbytes` apart.
// Walks the lines in order: a division per line (8 lines per step at Qwen3's gate/up) cost the
// kernel 2-7%.
struct NextPairPrefetch {
  const char* panel;  // the panel being fetched
  int64_t panel_stride, chunk_bytes, per_step, left, offset = 0;
  NextPairPrefetch(const uint8_t* start, int panels, int64_t lines, int64_t pbytes, int64_t steps)
      : panel(reinterpret_cast<const char*>(start)),
        panel_stride(pbytes),
        chunk_bytes(lines * 64),
        per_step((panels * lines + steps - 1) / steps),
        left(panels * lines) {}
  void step() {
    for (int64_t n = std::min(left, per_step); n > 0; --n, --left) {
      _mm_prefetch(panel + offset, _MM_HINT_T1);
      offset += 64;
      if (offset == chunk_bytes) offset = 0, panel += panel_stride;
    }
  }
};

// K-steps [0, ksteps) of one row block into C tiles 0-3 (0-1 only for a block of at most 16 rows:
// its lower A tile would be all padding).
template <bool kLowerHalf>
inline void block_steps(const uint8_t* A, const uint8_t* b0, const uint8_t* b1, int64_t ksteps,
                        NextPairPrefetch& prefetch) {
  for (int64_t kt = 0; kt < ksteps; ++kt) {
    prefetch.step();
    _tile_loadd(4, A + kt * kTiledChunkStride, 64);
    if constexpr (kLowerHalf) _tile_loadd(5, A + kt * kTiledChunkStride + 16 * 64, 64);
    _tile_loadd(6, b0 + kt * 1024, 64);
    _tile_loadd(7, b1 + kt * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kLowerHalf) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

}  // namespace

void gemm_bf16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  if (m <= 4) return avx512::gemm_bf16(m, K, group, a, panels, npanels, c, ldc);
  configure_tiles();
  const int64_t pbytes = panel_bytes(Method::kBf16, kKAlign, K);
  const int blocks = (m + kRowBlock - 1) / kRowBlock;
  const int pairs = (npanels + 1) / 2;
  const int64_t kc = chunk_k(blocks, K);
  thread_local AlignedVector<uint8_t> stage;  // row blocks that are not tiled yet
  thread_local std::vector<const uint8_t*> base;
  thread_local AlignedVector<float> acc;  // [blocks][pairs][32 rows][32]: sums c cannot hold
  if (stage.size() < static_cast<size_t>(blocks * kRowBlock * K * 2))
    stage.resize(blocks * kRowBlock * K * 2);
  if (acc.size() < static_cast<size_t>(blocks * pairs * 32 * 32)) acc.resize(blocks * pairs * 32 * 32);
  base.resize(blocks);
  for (int b = 0; b < blocks; ++b) {
    const int rows = std::min(kRowBlock, m - b * kRowBlock);
    base[b] = tiled_block(reinterpret_cast<const uint8_t* const*>(a.rows + b * kRowBlock), a.chunk_stride,
                          rows, K * 2, stage.data() + b * kRowBlock * K * 2);
  }
  // Where the sums of (pair, block) live: c itself for a full block of two panels, else acc.
  auto in_c = [&](int pair, int b) { return m - b * kRowBlock >= kRowBlock && 2 * pair + 1 < npanels; };
  auto sums = [&](int pair, int b, int64_t& stride) -> float* {
    if (in_c(pair, b)) {
      stride = ldc;
      return c + b * kRowBlock * ldc + 2 * pair * kPanelWidth;
    }
    stride = 32;
    return acc.data() + (static_cast<int64_t>(b) * pairs + pair) * 32 * 32;
  };
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t ksteps = std::min(kc, K - k0) / 32;
    const int64_t steps = blocks * ksteps;  // AMX steps per pair
    for (int pair = 0; pair < pairs; ++pair) {
      const int p = 2 * pair;
      const uint8_t* b0 = panels + p * pbytes + k0 / 32 * 1024;
      const uint8_t* b1 = p + 1 < npanels ? b0 + pbytes : b0;
      // Prefetch what the loop reads next: the next pair's chunk, else the next chunk's first pair.
      const bool last_pair = pair + 1 == pairs;
      const int64_t next_k0 = last_pair ? k0 + kc : k0;
      const int next_p = last_pair ? 0 : p + 2;
      const int next_panels = next_k0 < K ? std::min(2, npanels - next_p) : 0;
      NextPairPrefetch prefetch(panels + next_p * pbytes + next_k0 / 32 * 1024, next_panels,
                                std::min(kc, K - next_k0) / 32 * 1024 / 64, pbytes, steps);
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* A = base[b] + k0 / 32 * kTiledChunkStride;
        const bool lower = m - b * kRowBlock > 16;
        int64_t stride;
        float* s = sums(pair, b, stride);
        if (k0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, s, stride * 4);
          _tile_loadd(1, s + 16, stride * 4);
          if (lower) {
            _tile_loadd(2, s + 16 * stride, stride * 4);
            _tile_loadd(3, s + 16 * stride + 16, stride * 4);
          }
        }
        if (lower)
          block_steps<true>(A, b0, b1, ksteps, prefetch);
        else
          block_steps<false>(A, b0, b1, ksteps, prefetch);
        _tile_stored(0, s, stride * 4);
        _tile_stored(1, s + 16, stride * 4);
        if (lower) {
          _tile_stored(2, s + 16 * stride, stride * 4);
          _tile_stored(3, s + 16 * stride + 16, stride * 4);
        }
      }
    }
  }
  // Row blocks and the lone panel that accumulated in acc go to c.
  for (int pair = 0; pair < pairs; ++pair)
    for (int b = 0; b < blocks; ++b) {
      if (in_c(pair, b)) continue;  // not by the stride: acc's (32) is ldc in a call of two panels
      int64_t stride;
      const float* s = sums(pair, b, stride);
      const int rows = std::min(kRowBlock, m - b * kRowBlock);
      const int width = 2 * pair + 1 < npanels ? 32 : 16;
      for (int i = 0; i < rows; ++i)
        std::copy_n(s + i * 32, width, c + (b * kRowBlock + i) * ldc + 2 * pair * kPanelWidth);
    }
}

}  // namespace kt::kernels::KT_AMX_NAMESPACE
