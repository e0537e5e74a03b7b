// Does the AMX tile unit overlap with AVX-512 work on this core? Times, in short interleaved bursts
// (medians over rounds: a shared VM's AMX rate drifts 2x over seconds), the integer GEMM's building
// blocks per 16 x 16 x 64 dot product:
//   peak      4 dot products a step, A tiles loaded from L2, sums kept in the tiles (long K)
//   per-group the same with every step's sums zeroed and stored (one group of 64 a step)
//   two-sets  per-group with two sets of C tiles alternating, so one set's stores meet the other's dots
//   epilogue  the vector epilogue alone: 32 x 32 int32 sums to fp32, scaled, added (3 vector ops / 16)
//   both      per-group followed by the epilogue of the previous step's sums
// If "both" is near "per-group" the two units overlap; near the sum, they take turns.
//
//   g++ -O2 -mavx512f -mamx-tile -mamx-int8 bench/amx_overlap.cpp -o /tmp/amx_overlap && /tmp/amx_overlap
// Prints one JSON object (ns per dot product, medians).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

alignas(64) int8_t a_rows[64][16 * 64];  // 64 KiB: A tiles come from L2, as in the engine
alignas(64) int8_t b_tiles[2][16 * 64];
alignas(64) int32_t sums[2][4][16 * 16];
alignas(64) float acc[32][32];
alignas(64) float channel_scale[32];
float row_scale[32];

__attribute__((noinline)) void epilogue(int32_t (*d)[256]) {
  for (int i = 0; i < 32; ++i) {
    const __m512 sa = _mm512_set1_ps(row_scale[i]);
    for (int h = 0; h < 2; ++h) {
      const __m512 dv = _mm512_cvtepi32_ps(_mm512_load_si512(&d[(i / 16) * 2 + h][(i % 16) * 16]));
      const __m512 s = _mm512_mul_ps(_mm512_load_ps(channel_scale + 16 * h), sa);
      _mm512_store_ps(&acc[i][16 * h], _mm512_fmadd_ps(dv, s, _mm512_load_ps(&acc[i][16 * h])));
    }
  }
}

void dots_2x2(int j) {
  _tile_loadd(4, a_rows[2 * j], 64);
  _tile_dpbssd(0, 4, 6);
  _tile_dpbssd(1, 4, 7);
  _tile_loadd(5, a_rows[2 * j + 1], 64);
  _tile_dpbssd(2, 5, 6);
  _tile_dpbssd(3, 5, 7);
}

void store_2x2(int slot) {
  _tile_stored(0, sums[slot][0], 64);
  _tile_stored(1, sums[slot][1], 64);
  _tile_stored(2, sums[slot][2], 64);
  _tile_stored(3, sums[slot][3], 64);
}

void zero_2x2() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

void step(int kind, long i) {
  const int j = static_cast<int>(i & 31), slot = static_cast<int>(i & 1);
  switch (kind) {
    case 0:
      dots_2x2(j);
      break;
    case 1:
      zero_2x2();
      dots_2x2(j);
      store_2x2(slot);
      break;
    case 2:
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(4, a_rows[2 * j], 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_stored(2, sums[slot][2], 64);
      _tile_stored(3, sums[slot][3], 64);
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(5, a_rows[2 * j + 1], 64);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
      _tile_stored(0, sums[slot][0], 64);
      _tile_stored(1, sums[slot][1], 64);
      break;
    case 3:
      epilogue(sums[slot]);
      break;
    default:
      zero_2x2();
      dots_2x2(j);
      store_2x2(slot);
      epilogue(sums[1 - slot]);
  }
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::fprintf(stderr, "no AMX tile data permission on this CPU/kernel\n");
    return 1;
  }
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  std::memset(a_rows, 1, sizeof(a_rows));
  std::memset(b_tiles, 1, sizeof(b_tiles));
  std::fill_n(channel_scale, 32, 1e-3f);
  std::fill_n(row_scale, 32, 1e-2f);
  _tile_loadd(6, b_tiles[0], 64);
  _tile_loadd(7, b_tiles[1], 64);
  const char* names[] = {"peak", "per-group", "two-sets", "epilogue", "both"};
  constexpr int kKinds = 5, kRounds = 60;
  constexpr long kSteps = 20000;  // 4 dot products (or their epilogue) each
  std::vector<double> ns[kKinds];
  for (int round = 0; round < kRounds; ++round)
    for (int kind = 0; kind < kKinds; ++kind) {
      const auto t0 = std::chrono::steady_clock::now();
      for (long i = 0; i < kSteps; ++i) step(kind, i);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ns[kind].push_back(s / (4.0 * kSteps) * 1e9);
    }
  std::printf("{");
  for (int kind = 0; kind < kKinds; ++kind) {
    std::sort(ns[kind].begin(), ns[kind].end());
    std::printf("%s\"%s\": %.1f", kind ? ", " : "", names[kind], ns[kind][ns[kind].size() / 2]);
  }
  std::printf(", \"unit\": \"ns per 16x16x64 dot product, median of %d rounds\"}\n", kRounds);
}
