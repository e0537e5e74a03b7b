// The software model of the AMX tile unit (kernels/amx/tile_model.h): state per thread, as the
// tile registers are per logical processor; counters per process.
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/amx/tile_model.h"

namespace kt::amx_model {

namespace {

constexpr int kTiles = 8, kMaxRows = 16, kMaxColsb = 64;

struct TileState {
  bool configured = false;
  uint8_t start_row = 0;
  std::array<uint8_t, kTiles> rows{};
  std::array<uint16_t, kTiles> colsb{};
  alignas(64) uint8_t data[kTiles][kMaxRows][kMaxColsb] = {};
};

thread_local TileState state;
thread_local bool dry_run_only = false;  // run_program(..., dry_run): no memory is read or written

struct AtomicCounters {
  std::atomic<int64_t> configs{0}, loads{0}, stores{0}, zeros{0}, dots{0}, load_bytes{0}, store_bytes{0},
      macs{0};
} totals;

[[noreturn]] void fault(const char* instruction, const std::string& why) {
  throw TileFault(std::string("AMX model: ") + instruction + " faults: " + why);
}

void check_tile(const char* instruction, int t) {
  if (!state.configured) fault(instruction, "no tile configuration is loaded (LDTILECFG)");
  if (t < 0 || t >= kTiles) fault(instruction, "tile " + std::to_string(t) + " does not exist");
  if (state.rows[t] == 0) fault(instruction, "tile " + std::to_string(t) + " is not configured");
}

// Rows past `rows` and bytes past `colsb` of a written tile are zero (SDM: zero_upper_rows and
// write_row_and_zero in the instructions' pseudocode).
void zero_outside(int t) {
  for (int r = 0; r < kMaxRows; ++r) {
    const int keep = r < state.rows[t] ? state.colsb[t] : 0;
    std::memset(state.data[t][r] + keep, 0, kMaxColsb - keep);
  }
}

void check_dot(const char* instruction, int dst, int a, int b) {
  check_tile(instruction, dst), check_tile(instruction, a), check_tile(instruction, b);
  if (dst == a || dst == b || a == b) fault(instruction, "its three tile operands must differ");
  const int m = state.rows[dst], n = state.colsb[dst], k = state.colsb[a];
  std::string why;
  if (n % 4 || k % 4 || state.colsb[b] % 4)
    why = "a tile's bytes per row are not a multiple of 4";
  else if (state.rows[a] != m)
    why = "dst has " + std::to_string(m) + " rows, a " + std::to_string(state.rows[a]);
  else if (k / 4 != state.rows[b])
    why = "a has " + std::to_string(k / 4) + " dwords per row, b " + std::to_string(state.rows[b]) + " rows";
  else if (state.colsb[b] != n)
    why = "dst has " + std::to_string(n) + " bytes per row, b " + std::to_string(state.colsb[b]);
  if (!why.empty()) fault(instruction, why);
}

float bf16_daz(uint16_t v) {  // denormal bf16 inputs read as zero of their sign
  if ((v & 0x7f80) == 0) v &= 0x8000;
  const uint32_t bits = uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float ftz(float v) {
  return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v;
}

}  // namespace

Counters counters() {
  return {totals.configs, totals.loads,      totals.stores,      totals.zeros,
          totals.dots,    totals.load_bytes, totals.store_bytes, totals.macs};
}

void reset_counters() {
  for (auto* c : {&totals.configs, &totals.loads, &totals.stores, &totals.zeros, &totals.dots,
                  &totals.load_bytes, &totals.store_bytes, &totals.macs})
    c->store(0);
}

void ldtilecfg(const void* config) {
  uint8_t cfg[64];
  std::memcpy(cfg, config, 64);
  const uint8_t palette = cfg[0];
  if (palette == 0) return tilerelease();
  if (palette != 1) fault("LDTILECFG", "palette " + std::to_string(palette) + " is not supported (0 or 1)");
  for (int i = 2; i < 16; ++i)
    if (cfg[i]) fault("LDTILECFG", "reserved byte " + std::to_string(i) + " is not zero");
  TileState next;
  next.configured = true;
  next.start_row = cfg[1];
  for (int t = 0; t < 16; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, cfg + 16 + 2 * t, 2);
    const uint8_t rows = cfg[48 + t];
    const std::string tile = "tile " + std::to_string(t);
    if (t >= kTiles) {
      if (colsb || rows) fault("LDTILECFG", tile + " is configured but palette 1 has 8 tiles");
      continue;
    }
    if (rows > kMaxRows) fault("LDTILECFG", tile + " has " + std::to_string(rows) + " rows (at most 16)");
    if (colsb > kMaxColsb)
      fault("LDTILECFG", tile + " has " + std::to_string(colsb) + " bytes a row (at most 64)");
    if ((rows == 0) != (colsb == 0)) fault("LDTILECFG", tile + " has only one of rows and bytes per row set");
    next.rows[t] = rows, next.colsb[t] = colsb;
  }
  state = next;  // all tiles zero
  ++totals.configs;
}

void tilerelease() {
  state = TileState{};
}

void tileloadd(int t, const void* base, int64_t stride) {
  check_tile("TILELOADD", t);
  const auto* mem = static_cast<const uint8_t*>(base);
  for (int r = state.start_row; r < state.rows[t] && !dry_run_only; ++r)
    std::memcpy(state.data[t][r], mem + r * stride, state.colsb[t]);
  state.start_row = 0;
  zero_outside(t);
  ++totals.loads;
  totals.load_bytes += int64_t{state.rows[t]} * state.colsb[t];
}

void tilestored(int t, void* base, int64_t stride) {
  check_tile("TILESTORED", t);
  auto* mem = static_cast<uint8_t*>(base);
  for (int r = state.start_row; r < state.rows[t] && !dry_run_only; ++r)
    std::memcpy(mem + r * stride, state.data[t][r], state.colsb[t]);
  state.start_row = 0;
  ++totals.stores;
  totals.store_bytes += int64_t{state.rows[t]} * state.colsb[t];
}

void tilezero(int t) {
  check_tile("TILEZERO", t);
  std::memset(state.data[t], 0, sizeof(state.data[t]));
  ++totals.zeros;
}

void tdpb_int8(int dst, int a, int b, bool a_signed, bool b_signed) {
  check_dot("TDPB[SU][SU]D", dst, a, b);
  const int m = state.rows[dst], n = state.colsb[dst] / 4, k = state.colsb[a] / 4;
  auto byte = [](uint8_t v, bool is_signed) {
    return is_signed ? int32_t{static_cast<int8_t>(v)} : int32_t{v};
  };
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      uint32_t acc;  // int32 sums wrap: unsigned arithmetic, as the hardware's adder
      std::memcpy(&acc, &state.data[dst][i][4 * j], 4);
      for (int kk = 0; kk < k; ++kk)
        for (int e = 0; e < 4; ++e)
          acc += static_cast<uint32_t>(byte(state.data[a][i][4 * kk + e], a_signed) *
                                       byte(state.data[b][kk][4 * j + e], b_signed));
      std::memcpy(&state.data[dst][i][4 * j], &acc, 4);
    }
  zero_outside(dst);
  ++totals.dots;
  totals.macs += int64_t{m} * n * k * 4;
}

void tdpbf16ps(int dst, int a, int b) {
  check_dot("TDPBF16PS", dst, a, b);
  const int m = state.rows[dst], n = state.colsb[dst] / 4, k = state.colsb[a] / 4;
  auto bf16 = [](const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return bf16_daz(v);
  };
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      float acc;
      std::memcpy(&acc, &state.data[dst][i][4 * j], 4);
      for (int kk = 0; kk < k; ++kk)
        for (int e = 0; e < 2; ++e) {
          // The product of two bf16 values is exact in fp32, so one fused step rounds each sum once.
          acc = ftz(std::fma(bf16(&state.data[a][i][4 * kk + 2 * e]), bf16(&state.data[b][kk][4 * j + 2 * e]),
                             acc));
        }
      std::memcpy(&state.data[dst][i][4 * j], &acc, 4);
    }
  zero_outside(dst);
  ++totals.dots;
  totals.macs += int64_t{m} * n * k * 2;
}

void run_program(const void* config, std::span<const TileOp> ops, bool dry_run) {
  struct Release {
    ~Release() { tilerelease(), dry_run_only = false; }
  } release;
  dry_run_only = dry_run;
  ldtilecfg(config);
  for (const TileOp& op : ops) {
    const int* t = op.tile;
    switch (op.kind) {
      case TileOp::kLoad:
        tileloadd(t[0], op.memory, op.stride);
        break;
      case TileOp::kStore:
        tilestored(t[0], op.memory, op.stride);
        break;
      case TileOp::kZero:
        tilezero(t[0]);
        break;
      case TileOp::kDpbssd:
      case TileOp::kDpbsud:
      case TileOp::kDpbusd:
      case TileOp::kDpbuud:
        tdpb_int8(t[0], t[1], t[2], op.kind == TileOp::kDpbssd || op.kind == TileOp::kDpbsud,
                  op.kind == TileOp::kDpbssd || op.kind == TileOp::kDpbusd);
        break;
      case TileOp::kDpbf16ps:
        tdpbf16ps(t[0], t[1], t[2]);
        break;
    }
  }
}

}  // namespace kt::amx_model
