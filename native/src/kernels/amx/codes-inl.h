// A code layout's tile operation (../codes.h): the AMX kernels stage a group's parts as bytes of
// value(u) (avx512::CodeLanes::values) and multiply them with tdpbssd where the values are signed
// (INT8's q = u - 128, whose dot product then drops the offset term), tdpbsud where they are u.
#pragma once

#include <immintrin.h>

#include "../avx512/codes-inl.h"
#include "../codes.h"

// C tile += A tile (s8 activations) x B tile (layout C's staged values). A macro: GCC's tile
// intrinsics paste their tile numbers into the assembly text, so they must be literals.
#define KT_TILE_DOT_VALUES(C, c, a, b) \
  if constexpr (kSignedValues<C>)      \
    _tile_dpbssd(c, a, b);             \
  else                                 \
    _tile_dpbsud(c, a, b)
