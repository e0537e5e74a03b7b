// A software model of the AMX tile unit, exact to the Intel SDM, so that the AMX kernels can be
// compiled a second time against it (the "amx-emu" ISA) and tested on CPUs without AMX.
//
// Followed: Intel 64 and IA-32 Architectures SDM (Dec 2024), Vol. 1 ch. 18 "Programming with Intel
// AMX" (18.2 tile configuration, palette 1: 8 tiles, 16 rows, 64 bytes per row; TMUL limits
// K <= 16 rows, N <= 64 bytes) and Vol. 2 instruction pages LDTILECFG, TILELOADD, TILESTORED,
// TILEZERO, TILERELEASE, TDPBSSD/TDPBSUD/TDPBUSD/TDPBUUD, TDPBF16PS:
// - an instruction reads and writes only the rows and bytes the configuration gives its tiles;
//   rows past `rows` and bytes past `colsb` of a destination are zeroed;
// - LDTILECFG faults (#GP) on a palette other than 0 or 1, non-zero reserved bytes, rows > 16,
//   colsb > 64, a tile with exactly one of rows/colsb zero, or any setting for tiles 8-15;
//   palette 0 returns to the init state;
// - a dot product faults (#UD) without a configuration, on repeated tile operands, or on operand
//   shapes that disagree (dst.rows != a.rows, a.colsb != 4 * b.rows, dst.colsb != b.colsb, any
//   colsb not a multiple of 4);
// - integer dot products accumulate in int32, wrapping, no saturation;
// - TDPBF16PS: each fp32 sum += a.bf16 * b.bf16 for the two pairs in order, the product exact,
//   each sum rounded to nearest even; bf16 inputs that are denormal read as zero and denormal
//   sums are flushed to zero (DAZ / FTZ whatever MXCSR says); MXCSR is not updated.
// A fault throws kt::amx_model::TileFault naming the instruction and the reason.
//
// The model counts what crosses between tiles and memory, per process (counters()), so the
// structural efficiency of a kernel (dot products per tile load) is measurable on any host.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

namespace kt::amx_model {

struct TileFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Counters {
  int64_t configs = 0, loads = 0, stores = 0, zeros = 0, dots = 0;
  int64_t load_bytes = 0, store_bytes = 0;
  int64_t macs = 0;  // multiply-accumulates of the configured shapes (4 int8 or 2 bf16 per dword)
};
Counters counters();
void reset_counters();

void ldtilecfg(const void* config);
void tilerelease();
void tileloadd(int tile, const void* base, int64_t stride);
void tilestored(int tile, void* base, int64_t stride);
void tilezero(int tile);
// Signedness of the a (rows) and b (columns) bytes: ss, su, us, uu.
void tdpb_int8(int dst, int a, int b, bool a_signed, bool b_signed);
void tdpbf16ps(int dst, int a, int b);

// A straight-line tile program, run on the model (run_program) or on the tile unit itself
// (kt::kernels::amx::run_tile_program, tile_probe.cpp): how tests check the model's instructions
// against a scalar definition and, on a CPU with AMX, against the hardware.
struct TileOp {
  enum Kind { kLoad, kStore, kZero, kDpbssd, kDpbsud, kDpbusd, kDpbuud, kDpbf16ps } kind;
  int tile[3];  // the operand tiles: one for load / store / zero, (dst, a, b) for a dot product
  void* memory = nullptr;
  int64_t stride = 0;
};
// Loads `config` (64 bytes), runs `ops`, releases the tiles (also when an op faults). A dry run
// checks for faults without touching memory.
void run_program(const void* config, std::span<const TileOp> ops, bool dry_run = false);

}  // namespace kt::amx_model

namespace kt::kernels::amx {
// The same on the tile unit: dot products only on tiles (0, 1, 2), as the intrinsics need literals.
void run_tile_program(const void* config, std::span<const ::kt::amx_model::TileOp> ops);
}  // namespace kt::kernels::amx

// The intrinsics the AMX kernels use, routed to the model (compiled with KT_AMX_MODEL only).
#ifdef KT_AMX_MODEL
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbusd
#undef _tile_dpbuud
#undef _tile_dpbf16ps
#undef _tile_loadconfig
#undef _tile_release
#define _tile_loadconfig(config) ::kt::amx_model::ldtilecfg(config)
#define _tile_release() ::kt::amx_model::tilerelease()
#define _tile_loadd(t, base, stride) ::kt::amx_model::tileloadd(t, base, stride)
#define _tile_stream_loadd(t, base, stride) ::kt::amx_model::tileloadd(t, base, stride)
#define _tile_stored(t, base, stride) ::kt::amx_model::tilestored(t, base, stride)
#define _tile_zero(t) ::kt::amx_model::tilezero(t)
#define _tile_dpbssd(c, a, b) ::kt::amx_model::tdpb_int8(c, a, b, true, true)
#define _tile_dpbsud(c, a, b) ::kt::amx_model::tdpb_int8(c, a, b, true, false)
#define _tile_dpbusd(c, a, b) ::kt::amx_model::tdpb_int8(c, a, b, false, true)
#define _tile_dpbuud(c, a, b) ::kt::amx_model::tdpb_int8(c, a, b, false, false)
#define _tile_dpbf16ps(c, a, b) ::kt::amx_model::tdpbf16ps(c, a, b)
#endif
