// The fine-tuning kernels' portable twins (kt/kernels.h, LoraKernels): the adapters' fp32 loops,
// the 16 x 16 transpose and every method's tile decode (AVX2 and AVX-512 decode only the decoded
// methods of methods/decoders.h; FP8 takes this one on every family).
#include <cstdint>
#include <type_traits>

#include "../lora_loops.h"
#include "../packed_value.h"
#include "kt/float_types.h"
#include "kt/kernels.h"
#include "kt/quant_types.h"

namespace kt::kernels::scalar {

namespace {

// A 16 x 16 tile of bf16 weights from the packed layout to the transposed one, 512 bytes each way:
// src row kp (0..7) holds W[n][2kp], W[n][2kp + 1] for n = 0..15; dst row np holds W[2np][k],
// W[2np + 1][k] for k = 0..15, i.e. dst[np][k][nb] = src[k / 2][2np + nb][k % 2].
void transpose_tile(const uint16_t* src, uint16_t* dst) {
  for (int np = 0; np < 8; ++np)
    for (int k = 0; k < 16; ++k)
      for (int nb = 0; nb < 2; ++nb)
        dst[np * 32 + k * 2 + nb] = src[(k / 2) * 32 + (2 * np + nb) * 2 + k % 2];
}

// 16 channels x 16 K-values (kin, a multiple of 16, within group g) of a quantized method as bf16
// rows in BF16's packed layout (`stage`: 8 rows of 16 channels x 2 K-values).
template <Method M>
void decode_tile(const uint8_t* g, int group, int kin, uint16_t* stage) {
  for (int kk = 0; kk < kPanelWidth; ++kk)
    for (int nn = 0; nn < kPanelWidth; ++nn)
      stage[(kk / 2) * 32 + nn * 2 + kk % 2] = float_to_bf16(packed_value<M>(g, group, nn, kin + kk));
}

}  // namespace

void lora_kernels(LoraKernels& k) {
  lora_loops(k);
  k.transpose_tile = transpose_tile;
  lora::set_decoders(k, []<Method M>(std::integral_constant<Method, M>) -> DecodeTileFn {
    if constexpr (M == Method::kBf16) {
      return nullptr;  // read in place
    } else {
      return &decode_tile<M>;
    }
  });
}

}  // namespace kt::kernels::scalar
