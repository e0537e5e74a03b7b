// Code layouts: what a decoder's packed weight bytes hold (a decoder names one as `Codes`,
// ../methods/<method>/<method>.h). The kernel skeletons read codes only through a layout: its data
// here (bit width, value of each code, block shape) and its lane operations per ISA family
// (<isa>/codes-inl.h), so a new code width is a new layout and its lane operations, not an edit to
// every kernel.
//
// Block shape (quant_types.h): a group's weights are packed rows of 64 bytes, 16 channels x 4 bytes
// (byte j of channel n of row r at 4n + j). A byte holds kParts = 8 / kBits codes; part p of every
// byte of the group's rows holds the K-values [p, p + 1) * group / kParts, so row r, byte j, part
// p is K-value 4 * (r + p * packed_rows(group)) + j.
//
// A code u stands for the integer value(u): u - kBias, or kCodebook[u]. A decoder's offset wm is
// relative to the code (w = ws * u + wm, or ws * kCodebook[u] + wm); a kernel that multiplies
// value(u) rather than u adds the offset only where there is no bias, which holds it (INT8:
// wm = -128 ws): plus_value_offset.
#pragma once

#include <cstdint>

#include "kt/quant_types.h"

namespace kt::kernels {

// Twice the e2m1 values: the integers -12..12, so the FP4 methods run the integer A16 kernels
// exactly, with half the scale.
inline constexpr int8_t kE2m1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// One byte a weight, u = q + 128 (INT8).
struct OffsetBytes {
  static constexpr int kBits = 8;
  static constexpr int kBias = 128;
  static constexpr bool kHasCodebook = false;
  static constexpr const int8_t* kCodebook = nullptr;
  static constexpr bool kInt8Input = true;  // has an int8-activation kernel in every family
};

// Nibbles holding the integer q = u (INT4 and the int4 checkpoint formats).
struct IntNibbles {
  static constexpr int kBits = 4;
  static constexpr int kBias = 0;
  static constexpr bool kHasCodebook = false;
  static constexpr const int8_t* kCodebook = nullptr;
  static constexpr bool kInt8Input = true;
  // Each code's value in the decoded prefill (avx512/decoded_prefill-inl.h).
  alignas(64) static constexpr float kDecoded[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
};

// Nibbles holding e2m1 codes (the FP4 methods), looked up as twice their value.
struct E2m1Nibbles {
  static constexpr int kBits = 4;
  static constexpr int kBias = 0;
  // A flag beside the pointer: GCC does not fold `kCodebook != nullptr` to a constant under
  // -fsanitize=undefined.
  static constexpr bool kHasCodebook = true;
  static constexpr const int8_t* kCodebook = kE2m1Twice;
  static constexpr bool kInt8Input = false;  // looked-up codes: A16 kernels only
  // The e2m1 values themselves: the decoded prefill scales them by the decoder's block_scales.
  alignas(64) static constexpr float kDecoded[16] = {0,     0.5f,  1,  1.5f,  2,  3,  4,  6,
                                                     -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
};

// Codes per byte.
template <class C>
inline constexpr int kParts = 8 / C::kBits;

// Whether value(u) can be negative (else it is u itself).
template <class C>
inline constexpr bool kSignedValues = C::kBias != 0 || C::kHasCodebook;

// Packed rows of 64 bytes per group.
template <class C>
constexpr int packed_rows(int group) {
  return group * C::kBits / 32;
}

// The K-row (4 K-values a channel) that part p of packed row r holds, in a group of `rows` packed
// rows.
constexpr int part_row(int rows, int r, int p) {
  return r + p * rows;
}

// The group's first K-value in part p of packed row r.
template <class C>
constexpr int part_k(int group, int r, int p) {
  return 4 * part_row(packed_rows<C>(group), r, p);
}

// The signed integer value(u) a code stands for.
template <class C>
constexpr int code_value(uint8_t u) {
  if constexpr (C::kHasCodebook) return C::kCodebook[u];
  return int{u} - C::kBias;
}

// The packed row and part of K-values 4q .. 4q + 3 of a group (the inverse of part_k).
struct RowPart {
  int row, part;
};
template <class C>
inline RowPart row_part(int group, int q) {
  RowPart at{q, 0};
  for (int p = 1; p < kParts<C>; ++p)
    if (at.row >= packed_rows<C>(group)) at.row -= packed_rows<C>(group), ++at.part;
  return at;
}

// Code u of channel n, K-value k (0 <= k < group) of one group's weight block.
template <class C>
inline uint8_t packed_code(const uint8_t* w, int group, int n, int k) {
  const RowPart at = row_part<C>(group, k / 4);
  const uint8_t byte = w[(at.row * kPanelWidth + n) * 4 + k % 4];
  if constexpr (kParts<C> == 1) return byte;
  return (byte >> (C::kBits * at.part)) & ((1 << C::kBits) - 1);
}

// The decoder offset to add to ws * value(u): none where the bias holds it.
template <class C>
inline float value_offset(float wm) {
  return C::kBias == 0 ? wm : 0.0f;
}

// acc + wm * x, a group's offset term for a kernel that multiplied value(u): as value_offset, none
// where the bias holds it (the lane operations have the same for their lanes).
template <class C>
inline float plus_value_offset(float acc, float wm, float x) {
  return C::kBias == 0 ? acc + wm * x : acc;
}

}  // namespace kt::kernels
