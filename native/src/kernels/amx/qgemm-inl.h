// AMX quantized GEMM (INT8 and INT4), 32 rows x 32 channels per step, with the group epilogue of
// ../epilogue.h after every group. INT4 runs tdpbsud (s8 activations x u8 nibbles); INT8 weights
// are staged as signed q = u - 128 and run tdpbssd, which drops the offset term (and one of the
// epilogue's four vector operations per 16 sums) for INT8.
//
// Loop order: channel pair (2 panels) > group > block of 32 rows. The pair's B tiles of a group are
// loaded once and stay in tile registers for every row block; the pair's fp32 sums (m x 32) stay in
// L1; int32 tiles go to one of two small buffers so the vector epilogue of one row block overlaps
// the AMX work of the next. Groups of 32 run tiles half as deep in K (one dot product per group);
// small batches go to AVX-512.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "../epilogue.h"
#include "codes-inl.h"
#include "kt/quant_types.h"
#include "tile_config.h"

namespace kt::kernels::KT_AMX_NAMESPACE {

// B tile rows (group / 4 rows of 64 bytes) of one packed panel group, in L1: the values of its
// codes (INT4's nibbles unpacked, INT8's made signed). Tile loads straight from DRAM stalled AMX (INT8 ran at
// half INT4's speed); vector loads stream with the hardware prefetcher, helped by a prefetch four groups
// ahead (two groups ahead: the INT8 kernel alone ran at x0.92-0.96, 32-128 rows).
template <class D>
inline void stage_group(const uint8_t* w, int group, int64_t gbytes, uint8_t* out) {
  for (int64_t off = 0; off < gbytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * gbytes + off), _MM_HINT_T0);
  using C = typename D::Codes;
  const avx512::CodeLanes<C> codes;
  const int rows = packed_rows<C>(group);
  for (int r = 0; r < rows; ++r) {
    const __m512i v = _mm512_loadu_si512(w + r * 64);
    for (int p = 0; p < kParts<C>; ++p)
      _mm512_store_si512(out + part_row(rows, r, p) * 64, codes.values(v, p));
  }
}

// The base of each block of 32 rows of `a` in the tiled layout (tiled_block), staged in `stage`
// where the rows are not tiled already.
inline void tile_row_blocks(const QuantRows& a, int m, int64_t K, AlignedVector<uint8_t>& stage,
                            std::vector<const uint8_t*>& base) {
  const int blocks = (m + kRowBlock - 1) / kRowBlock;
  if (stage.size() < static_cast<size_t>(blocks * kRowBlock * K)) stage.resize(blocks * kRowBlock * K);
  base.resize(blocks);
  for (int b = 0; b < blocks; ++b) {
    const int rows = std::min(kRowBlock, m - b * kRowBlock);
    base[b] = tiled_block(reinterpret_cast<const uint8_t* const*>(a.rows + b * kRowBlock), a.chunk_stride,
                          rows, K, stage.data() + b * kRowBlock * K);
  }
}

inline bool one_scale_per_row(const QuantRows& a, int m, int64_t groups) {
  for (int i = 0; i < m; ++i)
    for (int64_t g = 1; g < groups; ++g)
      if (a.scale[i][g] != a.scale[i][0]) return false;
  return true;
}

// One INT4 panel over all of K as signed int8 B-tile rows (K / 4 rows of 16 channels x 4 K-values)
// with one scale per channel: q8 = round(w * 127 / max|w|) for w = scale * q + min, computed in 16-bit
// fixed point (8 fraction bits; A = scale * f and B = min * f + 1/2 rounded per group, f = 127 * 256 /
// max|w|). channel_scale[c] = max|w| / 127, the bound of the channel's w over its groups. The work goes
// a few packed rows at a time (`stage`), so that a kernel can spread it over its tile instructions.
template <class D>
class Int4PanelStager {
  using C = typename D::Codes;
  static_assert(!kSignedValues<C>, "requantizes unsigned integer codes");

 public:
  Int4PanelStager() = default;
  Int4PanelStager(const uint8_t* panel, int64_t K, int group, uint8_t* out, float* channel_scale)
      : panel_(panel),
        out_(out),
        group_(group),
        rows_(packed_rows<C>(group)),
        groups_(K / group),
        gbytes_(group_bytes(D::kMethod, group)),
        wbytes_(group_weight_bytes(D::kMethod, group)) {
    __m512 peak = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups_; ++g) {
      __m512 ws, wm;
      scales_of(g, ws, wm);
      const __m512 top =
          _mm512_add_ps(wm, _mm512_mul_ps(_mm512_set1_ps(static_cast<float>((1 << C::kBits) - 1)), ws));
      peak = _mm512_max_ps(peak, _mm512_max_ps(_mm512_abs_ps(wm), _mm512_abs_ps(top)));
    }
    _mm512_storeu_ps(channel_scale, _mm512_div_ps(peak, _mm512_set1_ps(127.0f)));
    const __mmask16 live = _mm512_cmp_ps_mask(peak, _mm512_setzero_ps(), _CMP_GT_OQ);
    fixed_ = _mm512_maskz_div_ps(live, _mm512_set1_ps(127.0f * 256.0f), peak);
  }

  int64_t rows_left() const { return (groups_ - g_) * rows_ - r_; }

  // The next n packed rows (64 bytes: a B-tile row per part), fewer at the end.
  void stage(int64_t n) {
    for (; n > 0 && g_ < groups_; --n) {
      if (r_ == 0) start_group();
      const __m512i v = _mm512_loadu_si512(panel_ + g_ * gbytes_ + r_ * 64);
      const avx512::CodeLanes<C> codes;
      uint8_t* dst = out_ + g_ * group_ / 4 * 64;
      for (int p = 0; p < kParts<C>; ++p)
        _mm512_store_si512(dst + part_row(rows_, r_, p) * 64, requantize(codes.codes(v, p)));
      if (++r_ == rows_) r_ = 0, ++g_;
    }
  }

 private:
  void scales_of(int64_t g, __m512& ws, __m512& wm) const {
    std::tie(ws, wm) = D::template scales<Lanes>(panel_ + g * gbytes_ + wbytes_, 0);
  }

  void start_group() {
    __m512 ws, wm;
    scales_of(g_, ws, wm);
    const __m512i a32 = _mm512_cvtps_epi32(_mm512_mul_ps(ws, fixed_));
    const __m512i b32 =
        _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(wm, fixed_)), _mm512_set1_epi32(128));
    // int16 lane i of a 32-byte half of a tile row belongs to channel i / 4 of that half; the int32
    // of channel c holds its value in int16 lane 2c.
    const __m512i to_lo = _mm512_set_epi16(14, 14, 14, 14, 12, 12, 12, 12, 10, 10, 10, 10, 8, 8, 8, 8, 6, 6,
                                           6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
    const __m512i to_hi = _mm512_add_epi16(to_lo, _mm512_set1_epi16(16));
    a_lo_ = _mm512_permutexvar_epi16(to_lo, a32), a_hi_ = _mm512_permutexvar_epi16(to_hi, a32);
    b_lo_ = _mm512_permutexvar_epi16(to_lo, b32), b_hi_ = _mm512_permutexvar_epi16(to_hi, b32);
  }

  __m512i requantize(__m512i q) const {
    __m512i lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(q));
    __m512i hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(q, 1));
    lo = _mm512_srai_epi16(_mm512_add_epi16(_mm512_mullo_epi16(lo, a_lo_), b_lo_), 8);
    hi = _mm512_srai_epi16(_mm512_add_epi16(_mm512_mullo_epi16(hi, a_hi_), b_hi_), 8);
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), _mm512_packs_epi16(lo, hi));
  }

  const uint8_t* panel_ = nullptr;
  uint8_t* out_ = nullptr;
  int group_ = 0, rows_ = 0;
  int64_t groups_ = 0, gbytes_ = 0, wbytes_ = 0;
  int64_t g_ = 0;
  int r_ = 0;
  __m512 fixed_ = _mm512_setzero_ps();
  __m512i a_lo_, a_hi_, b_lo_, b_hi_;
};

// One panel of a layout whose bytes are int8 values (INT8's q = u - 128) and whose rows have one scale
// over all of K (every group's scale block alike: the directories kt-kernel wrote) as signed int8
// B-tile rows, with that scale per channel. The same interface as Int4PanelStager; nothing to
// requantize.
template <class D>
class Int8PanelStager {
  using C = typename D::Codes;

 public:
  static constexpr bool kApplies = kParts<C> == 1 && kSignedValues<C>;

  Int8PanelStager() = default;
  Int8PanelStager(const uint8_t* panel, int64_t K, int group, uint8_t* out, float* channel_scale)
      : panel_(panel),
        out_(out),
        rows_(packed_rows<C>(group)),
        groups_(K / group),
        gbytes_(group_bytes(D::kMethod, group)) {
    _mm512_storeu_ps(channel_scale,
                     D::template scales<Lanes>(panel + group_weight_bytes(D::kMethod, group), 0).first);
  }

  int64_t rows_left() const { return (groups_ - g_) * rows_ - r_; }

  // The next n packed rows (64 bytes, one B-tile row), fewer at the end.
  void stage(int64_t n) {
    const avx512::CodeLanes<C> codes;
    for (; n > 0 && g_ < groups_; --n) {
      const __m512i v = _mm512_loadu_si512(panel_ + g_ * gbytes_ + r_ * 64);
      _mm512_store_si512(out_ + (g_ * rows_ + r_) * 64, codes.values(v, 0));
      if (++r_ == rows_) r_ = 0, ++g_;
    }
  }

 private:
  const uint8_t* panel_ = nullptr;
  uint8_t* out_ = nullptr;
  int rows_ = 0;
  int64_t groups_ = 0, gbytes_ = 0;
  int64_t g_ = 0;
  int r_ = 0;
};

// Whether every channel of every panel has one scale over all of K: each group's scale block equals
// the first group's, bit for bit.
template <class D>
inline bool rows_share_scale(const uint8_t* panels, int npanels, int64_t K, int group) {
  const int64_t pbytes = panel_bytes(D::kMethod, group, K), gbytes = group_bytes(D::kMethod, group);
  const int64_t wbytes = group_weight_bytes(D::kMethod, group), sbytes = gbytes - wbytes;
  for (int p = 0; p < npanels; ++p) {
    const uint8_t* first = panels + p * pbytes + wbytes;
    for (int64_t g = 1; g < K / group; ++g)
      if (std::memcmp(first, first + g * gbytes, sbytes) != 0) return false;
  }
  return true;
}

// Rows with one activation scale over weights with one int8 scale per channel: per channel pair,
// both panels staged over all of K as int8 (S: Int4PanelStager requantizes INT4, Int8PanelStager
// copies INT8 whose rows share a scale; 32 * K bytes in L2), then per block of 32 rows 2 A and 2 B
// tile loads and 4 tdpbssd per 64 K-values, the sums kept in the tiles over all of K, and one
// epilogue (c = sum * row scale * channel scale). The group epilogue of gemm_q8, 4 vector
// operations per 16 sums per group, is what bounds that kernel. The next pair is staged a few rows
// per K-step, between the tile instructions of this one (two sets of staged weights).
template <class D, class S>
void gemm_whole_k(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels,
                  float* c, int64_t ldc) {
  configure_tiles(64);
  const int blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t pbytes = panel_bytes(D::kMethod, group, K);
  const int64_t ksteps = K / 64;
  struct Scratch {
    AlignedVector<uint8_t> stage;      // rows that are not tiled yet
    std::vector<const uint8_t*> base;  // per row block
    AlignedVector<uint8_t> weights;    // two sets of a pair's panels as int8 B-tile rows
    alignas(64) int32_t dots[32][32];
    alignas(64) float channel_scale[2][32];
  };
  Scratch& scratch = *thread_scratch<Scratch>();
  auto& stage = scratch.stage;
  auto& base = scratch.base;
  auto& weights = scratch.weights;
  auto& dots = scratch.dots;
  auto& channel_scale = scratch.channel_scale;
  if (weights.size() < static_cast<size_t>(64 * K)) weights.resize(64 * K);
  tile_row_blocks(a, m, K, stage, base);
  S next[2];
  auto start_pair = [&](int p) {  // into set (p / 2) % 2
    uint8_t* out = weights.data() + (p / 2 % 2) * 32 * K;
    for (int h = 0; h < 2; ++h)
      next[h] = p + h < npanels ? S(panels + (p + h) * pbytes, K, group, out + h * 16 * K,
                                    channel_scale[p / 2 % 2] + 16 * h)
                                : S();
  };
  auto stage_next = [&](int64_t n) {
    const int64_t first = std::min(n, next[0].rows_left());
    next[0].stage(first);
    next[1].stage(n - first);
  };
  start_pair(0);
  stage_next(next[0].rows_left() + next[1].rows_left());
  for (int p = 0; p < npanels; p += 2) {
    const bool two = p + 1 < npanels;
    const int set = p / 2 % 2;
    const uint8_t* b0 = weights.data() + set * 32 * K;
    const uint8_t* b1 = two ? b0 + 16 * K : b0;
    const float* scale = channel_scale[set];
    int64_t per_step = 0;
    if (p + 2 < npanels) {
      start_pair(p + 2);
      const int64_t rows = next[0].rows_left() + next[1].rows_left();
      per_step = (rows + blocks * ksteps - 1) / (blocks * ksteps);
    }
    for (int b = 0; b < blocks; ++b) {
      const int rows = std::min(kRowBlock, m - b * kRowBlock);
      const bool lower = rows > 16;  // else the lower A tile is all padding
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t t = 0; t < ksteps; ++t) {
        const uint8_t* chunk = base[b] + t * kTiledChunkStride;
        _tile_loadd(6, b0 + t * 1024, 64);
        _tile_loadd(7, b1 + t * 1024, 64);
        _tile_loadd(4, chunk, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        if (lower) {
          _tile_loadd(5, chunk + 16 * 64, 64);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        }
        if (per_step) stage_next(per_step);
      }
      _tile_stored(0, &dots[0][0], 128);
      _tile_stored(1, &dots[0][16], 128);
      if (lower) {
        _tile_stored(2, &dots[16][0], 128);
        _tile_stored(3, &dots[16][16], 128);
      }
      for (int i = 0; i < rows; ++i) {
        const int r = b * kRowBlock + i;
        const __m512 sa = _mm512_set1_ps(a.scale[r][0]);
        for (int h = 0; h < (two ? 2 : 1); ++h) {
          const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(&dots[i][16 * h]));
          const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scale + 16 * h), sa);
          _mm512_storeu_ps(c + r * ldc + (p + h) * kPanelWidth, _mm512_mul_ps(sum, s));
        }
      }
    }
  }
}

inline constexpr int kQ8SliceRows = 64;

template <class D>
void gemm_q8(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
             int64_t ldc) {
  using C = typename D::Codes;
  if (m <= 4 || group % 32 != 0) return avx512::gemm_q8<D>(m, K, group, a, panels, npanels, c, ldc);
  if constexpr (method_traits(D::kMethod).gate_up_input_per_row)
    if (m >= kAmxWholeKMinRows && one_scale_per_row(a, m, K / group))
      return gemm_whole_k<D, Int4PanelStager<D>>(m, K, group, a, panels, npanels, c, ldc);
  if constexpr (Int8PanelStager<D>::kApplies)
    if (m >= kAmxInt8WholeKMinRows && one_scale_per_row(a, m, K / group) &&
        rows_share_scale<D>(panels, npanels, K, group))
      return gemm_whole_k<D, Int8PanelStager<D>>(m, K, group, a, panels, npanels, c, ldc);
  // Each group's epilogue rereads the fp32 sums of every row of the call while the activation tiles
  // stream through L1: larger calls run in slices of whole row blocks (at 256 rows x1.12-1.21 over
  // one pass; the pair's staged weights are reread from L2 per slice).
  if (m > kQ8SliceRows) {
    const int slices = (m + kQ8SliceRows - 1) / kQ8SliceRows;
    const int rows = static_cast<int>(round_up((m + slices - 1) / slices, kRowBlock));
    for (int r0 = 0; r0 < m; r0 += rows) {
      const QuantRows slice{a.rows + r0, a.chunk_stride, a.scale + r0, a.scaled_sum + r0};
      gemm_q8<D>(std::min(rows, m - r0), K, group, slice, panels, npanels, c + r0 * ldc, ldc);
    }
    return;
  }
  const int k_bytes = std::min(group, 64);  // K-values per dot product
  configure_tiles(k_bytes);
  const int64_t groups = K / group;
  const int ktiles = group / k_bytes;
  const int blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t pbytes = panel_bytes(D::kMethod, group, K);
  const int64_t gbytes = group_bytes(D::kMethod, group), wbytes = group_weight_bytes(D::kMethod, group);
  struct Scratch {
    AlignedVector<uint8_t> stage;      // rows that are not tiled yet
    std::vector<const uint8_t*> base;  // per row block
    std::vector<float> acc;            // [blocks * 32][32]
    alignas(64) int32_t dots[2][32][32];
    alignas(64) uint8_t staged[2][128 * 16];
  };
  // Plain references, not a structured binding: the lambdas below capture them (clang before 16,
  // include-what-you-use's, cannot capture a binding).
  Scratch& scratch = *thread_scratch<Scratch>();
  auto& stage = scratch.stage;
  auto& base = scratch.base;
  auto& acc = scratch.acc;
  auto& dots = scratch.dots;
  auto& staged = scratch.staged;
  if (acc.size() < static_cast<size_t>(blocks * kRowBlock * 32)) acc.resize(blocks * kRowBlock * 32);
  tile_row_blocks(a, m, K, stage, base);
  // The epilogue of a block runs one AMX step later (software pipelining): vector loads of
  // freshly stored tiles wait for the stores to commit, so reading them at once serialized the two
  // units (the kernel ran at 16% of the tdpbsud rate; delayed, the stores have landed).
  struct Pending {
    int block = -1;
    int slot = 0;  // which dots buffer: alternates every step, so the pending one is never overwritten
    int64_t group = 0;
    __m512 ws[2], wm[2];
  };
  auto epilogue = [&](const Pending& pend) {
    const int b = pend.block;
    const int rows = std::min(kRowBlock, m - b * kRowBlock);
    int32_t (*d)[32] = dots[pend.slot];
    float* sums = acc.data() + b * kRowBlock * 32;
    for (int i = 0; i < rows; ++i) {
      const int r = b * kRowBlock + i;
      const __m512 sa = _mm512_set1_ps(a.scale[r][pend.group]);
      for (int h = 0; h < 2; ++h) {
        const __m512 dv = _mm512_cvtepi32_ps(_mm512_load_si512(&d[i][16 * h]));
        __m512 s = _mm512_loadu_ps(sums + i * 32 + 16 * h);
        s = _mm512_fmadd_ps(_mm512_mul_ps(dv, pend.ws[h]), sa, s);
        s = avx512::CodeLanes<C>::plus_value_offset(s, pend.wm[h],
                                                    _mm512_set1_ps(a.scaled_sum[r][pend.group]));
        _mm512_storeu_ps(sums + i * 32 + 16 * h, s);
      }
    }
  };
  for (int p = 0; p < npanels; p += 2) {
    const bool two = p + 1 < npanels;
    const uint8_t* w0 = panels + p * pbytes;
    const uint8_t* w1 = two ? w0 + pbytes : w0;
    std::fill_n(acc.data(), blocks * kRowBlock * 32, 0.0f);
    Pending pending;
    int step = 0;
    for (int64_t gi = 0; gi < groups; ++gi) {
      const uint8_t* g0 = w0 + gi * gbytes;
      const uint8_t* g1 = w1 + gi * gbytes;
      stage_group<D>(g0, group, gbytes, staged[0]);
      stage_group<D>(g1, group, gbytes, staged[1]);
      Pending now;
      now.group = gi;
      for (int h = 0; h < 2; ++h) {
        std::tie(now.ws[h], now.wm[h]) = D::template scales<Lanes>((h == 0 ? g0 : g1) + wbytes, 0);
      }
      if (ktiles == 1) {  // the group's B tiles stay loaded for every row block
        _tile_loadd(6, staged[0], 64);
        _tile_loadd(7, staged[1], 64);
      }
      for (int b = 0; b < blocks; ++b, ++step) {
        int32_t (*d)[32] = dots[step & 1];
        const bool lower = m - b * kRowBlock > 16;  // else the lower A tile is all padding
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int t = 0; t < ktiles; ++t) {  // groups of 128: two K-tiles per group
          // K-value k0 of row 0: in 64-byte chunk k0 / 64 of the tiled layout, at byte k0 % 64.
          const int64_t k0 = gi * group + t * k_bytes;
          const uint8_t* chunk = base[b] + k0 / kChunkBytes * kTiledChunkStride + k0 % kChunkBytes;
          if (ktiles > 1) {
            _tile_loadd(6, staged[0] + t * 1024, 64);
            _tile_loadd(7, staged[1] + t * 1024, 64);
          }
          _tile_loadd(4, chunk, 64);
          KT_TILE_DOT_VALUES(C, 0, 4, 6);
          KT_TILE_DOT_VALUES(C, 1, 4, 7);
          if (lower) {
            _tile_loadd(5, chunk + 16 * 64, 64);
            KT_TILE_DOT_VALUES(C, 2, 5, 6);
            KT_TILE_DOT_VALUES(C, 3, 5, 7);
          }
        }
        _tile_stored(0, &d[0][0], 128);
        _tile_stored(1, &d[0][16], 128);
        if (lower) {
          _tile_stored(2, &d[16][0], 128);
          _tile_stored(3, &d[16][16], 128);
        }
        if (pending.block >= 0) epilogue(pending);
        now.block = b;
        now.slot = step & 1;
        pending = now;
      }
    }
    if (pending.block >= 0) epilogue(pending);
    const int width = two ? 32 : 16;
    for (int i = 0; i < m; ++i) std::copy_n(acc.data() + i * 32, width, c + i * ldc + p * kPanelWidth);
  }
}

}  // namespace kt::kernels::KT_AMX_NAMESPACE
