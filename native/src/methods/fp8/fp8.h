// FP8 and FP8_PERCHANNEL: float8 e4m3 weights as checkpoints ship them, with fp32 scales per
// 128 x 128 block (DeepSeek-V3, Qwen3-FP8, ...) or per output channel (GLM-4.7-FP8). Both pack into
// one layout, so they share every kernel: a kernel decodes e4m3 to bf16 or fp32 in registers (exact:
// e4m3 has 4 significant bits) and multiplies the group's sums by its scales.
//
// Packed group (quant_types.h): 64 rows of 16 channels x 2 K-values (BF16's pair order at one byte
// a weight), stored two rows per 64 bytes with their 8-byte pieces interleaved: in each 16-byte lane
// L of a block, bytes 0-7 are bytes 8L..8L+7 of the even row and bytes 8-15 those of the odd row. So
// AVX-512 turns 64 bytes into two bf16 rows with two byte lookups and one unpack pair (the unpacks
// work within 16-byte lanes). Then the group's 16 channel scales in fp32.
#pragma once

#include <cstdint>

#include "kt/kernels.h"
#include "kt/packing.h"
#include "kt/quantize.h"

namespace kt::fp8 {

inline constexpr int kBlock = 128;  // K-values per packed group; FP8's scale blocks are 128 x 128

// Round to nearest even, saturating at +-448 (the largest finite e4m3fn). (e4m3_to_float and
// e4m3_is_nan: kt/float_types.h.)
uint8_t float_to_e4m3(float x);

// Byte offset in a packed group of row r (K-values 2r, 2r + 1), channel n, K-value 2r + j.
constexpr int64_t packed_offset(int r, int n, int j) {
  const int b = 2 * n + j;  // byte of the plain 32-byte row
  return (r / 2) * 64 + (b / 8) * 16 + (r % 2) * 8 + b % 8;
}

// The bf16 bits of e4m3 magnitude code m (0..126; the sign is bit 7 of the byte), exact.
constexpr uint16_t e4m3_magnitude_as_bf16(int m) {
  const int exp = (m >> 3) & 0xf, man = m & 7;
  if (exp != 0) return static_cast<uint16_t>(((exp + 120) << 7) | (man << 4));
  if (man == 0) return 0;
  const int top = man >= 4 ? 2 : man >= 2 ? 1 : 0;  // value man * 2^-9 = 2^(top - 9) * (man / 2^top)
  return static_cast<uint16_t>(((top - 9 + 127) << 7) | (((man << (7 - top)) & 0x7f)));
}

// Group `gi` of the panel whose first channel is packed row n0, into `dst` (group_bytes long).
// Throws naming the row and column of a NaN weight.
void pack_group(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi, uint8_t* dst);

// Rows [row_begin, row_end) of a dense matrix quantized to e4m3 with amax / 448 scales (per block
// of 128 x 128, or per row); a block method needs whole blocks of rows.
void quantize_rows(const void* src, DType dtype, CanonicalMatrix& dst, int64_t row_begin, int64_t row_end);

}  // namespace kt::fp8

namespace kt::kernels {
// The A16 GEMM of both FP8 methods, per family (src/methods/fp8/<isa>.cpp).
#define KT_DECLARE_FP8(ns)                                                                          \
  namespace ns {                                                                                    \
  void gemm_fp8(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, \
                float* c, int64_t ldc);                                                             \
  }
KT_DECLARE_FP8(scalar)
KT_DECLARE_FP8(avx2)
KT_DECLARE_FP8(avx512)
#undef KT_DECLARE_FP8
}  // namespace kt::kernels
