// Tile programs on the tile unit itself, the hardware twin of amx_model::run_program: tests run
// the same program on both to check the model against the silicon.
#include <immintrin.h>

#include <cstdint>
#include <span>
#include <stdexcept>

#include "tile_model.h"

namespace kt::kernels::amx {

namespace {

// Tile numbers must be literals in the intrinsics: one case per tile.
#define KT_EACH_TILE(op, t, ...)                              \
  switch (t) {                                                \
    case 0:                                                   \
      op(0, __VA_ARGS__);                                     \
      break;                                                  \
    case 1:                                                   \
      op(1, __VA_ARGS__);                                     \
      break;                                                  \
    case 2:                                                   \
      op(2, __VA_ARGS__);                                     \
      break;                                                  \
    case 3:                                                   \
      op(3, __VA_ARGS__);                                     \
      break;                                                  \
    case 4:                                                   \
      op(4, __VA_ARGS__);                                     \
      break;                                                  \
    case 5:                                                   \
      op(5, __VA_ARGS__);                                     \
      break;                                                  \
    case 6:                                                   \
      op(6, __VA_ARGS__);                                     \
      break;                                                  \
    case 7:                                                   \
      op(7, __VA_ARGS__);                                     \
      break;                                                  \
    default:                                                  \
      throw std::invalid_argument("tile numbers are 0 to 7"); \
  }
#define KT_ZERO(t, unused) _tile_zero(t)

}  // namespace

void run_tile_program(const void* config, std::span<const amx_model::TileOp> ops) {
  using Op = amx_model::TileOp;
  for (const Op& op : ops)
    if (op.kind >= Op::kDpbssd && (op.tile[0] != 0 || op.tile[1] != 1 || op.tile[2] != 2))
      throw std::invalid_argument("dot products on the tile unit run on tiles (0, 1, 2) only");
  _tile_loadconfig(config);
  for (const Op& op : ops) {
    switch (op.kind) {
      case Op::kLoad:
        KT_EACH_TILE(_tile_loadd, op.tile[0], op.memory, op.stride);
        break;
      case Op::kStore:
        KT_EACH_TILE(_tile_stored, op.tile[0], op.memory, op.stride);
        break;
      case Op::kZero:
        KT_EACH_TILE(KT_ZERO, op.tile[0], 0);
        break;
      case Op::kDpbssd:
        _tile_dpbssd(0, 1, 2);
        break;
      case Op::kDpbsud:
        _tile_dpbsud(0, 1, 2);
        break;
      case Op::kDpbusd:
        _tile_dpbusd(0, 1, 2);
        break;
      case Op::kDpbuud:
        _tile_dpbuud(0, 1, 2);
        break;
      case Op::kDpbf16ps:
        _tile_dpbf16ps(0, 1, 2);
        break;
    }
  }
  _tile_release();
}

#undef KT_ZERO
#undef KT_EACH_TILE

}  // namespace kt::kernels::amx
