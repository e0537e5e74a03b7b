// The fine-tuning kernels of the AVX-512 family (kt/kernels.h, LoraKernels): the adapters' fp32 loops
// compiled for it, the 16 x 16 transpose and the decoded methods' tile decode.
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "../../methods/decoders.h"
#include "../epilogue.h"
#include "../lora_loops.h"
#include "../scalar/lanes.h"
#include "codes-inl.h"
#include "kt/kernels.h"
#include "kt/quant_types.h"

namespace kt::kernels::avx512 {

namespace {

// The scalar transpose_tile (../scalar/lora_ops.cpp) with AVX-512: in each 8-byte unit (2 channels x
// 2 K-values) swap the middle values, then transpose the 8 x 8 units (three rounds of two-source
// permutes).
void transpose_tile(const uint16_t* src, uint16_t* dst) {
  const __m512i swap =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
  __m512i r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm512_shuffle_epi8(_mm512_loadu_si512(src + i * 32), swap);
  const __m512i even = _mm512_setr_epi64(0, 8, 2, 10, 4, 12, 6, 14),
                odd = _mm512_setr_epi64(1, 9, 3, 11, 5, 13, 7, 15);
  __m512i lo[4], hi[4];  // lo[i]: units 0, 2, 4, 6 of rows 2i, 2i + 1; hi[i]: units 1, 3, 5, 7
  for (int i = 0; i < 4; ++i) {
    lo[i] = _mm512_permutex2var_epi64(r[2 * i], even, r[2 * i + 1]);
    hi[i] = _mm512_permutex2var_epi64(r[2 * i], odd, r[2 * i + 1]);
  }
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13),
                second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  __m512i q[4][2];  // q[j][i]: units j and j + 4 of rows 4i..4i + 3 (j = 0: lo's first, 1: hi's first, ...)
  for (int i = 0; i < 2; ++i) {
    q[0][i] = _mm512_permutex2var_epi64(lo[2 * i], first, lo[2 * i + 1]);   // units 0, 4
    q[2][i] = _mm512_permutex2var_epi64(lo[2 * i], second, lo[2 * i + 1]);  // units 2, 6
    q[1][i] = _mm512_permutex2var_epi64(hi[2 * i], first, hi[2 * i + 1]);   // units 1, 5
    q[3][i] = _mm512_permutex2var_epi64(hi[2 * i], second, hi[2 * i + 1]);  // units 3, 7
  }
  const __m512i low_half = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11),
                high_half = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  for (int j = 0; j < 4; ++j) {
    _mm512_storeu_si512(dst + j * 32, _mm512_permutex2var_epi64(q[j][0], low_half, q[j][1]));
    _mm512_storeu_si512(dst + (j + 4) * 32, _mm512_permutex2var_epi64(q[j][0], high_half, q[j][1]));
  }
}

// The scalar decode_tile for the decoded methods (methods/decoders.h) with AVX-512: per packed row
// of 4 K-values, 4 vectors of 16 channels' codes, each value = value(code) * scale + offset
// (../codes.h), rounded to bf16 (to nearest even).
template <Method M>
void decode_tile(const uint8_t* g, int group, int kin, uint16_t* stage) {
  using D = typename DecoderFor<M>::type;
  using C = typename D::Codes;
  const uint8_t* block = g + group_weight_bytes(M, group);
  alignas(64) float scale[kPanelWidth], offset[kPanelWidth];
  for (int n = 0; n < kPanelWidth; ++n) {
    const auto [s, o] = D::template scales<scalar::Lanes>(block, n);
    scale[n] = s;
    offset[n] = value_offset<C>(o);
  }
  const __m512 vs = _mm512_load_ps(scale), vo = _mm512_load_ps(offset);
  const CodeLanes<C> codes;
  for (int q = 0; q < 4; ++q) {
    const RowPart at = row_part<C>(group, (kin + 4 * q) / 4);  // K-values kin + 4q .. + 3
    const __m512i v = _mm512_loadu_si512(g + at.row * 64);
    __m512i bits[4];
    for (int j = 0; j < 4; ++j) {
      const __m512 value = codes.lane_value(codes.lane_code(v, 8 * j + C::kBits * at.part));
      const __m512i b = _mm512_castps_si512(_mm512_fmadd_ps(value, vs, vo));
      const __m512i round = _mm512_add_epi32(
          _mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)));
      bits[j] = _mm512_srli_epi32(_mm512_add_epi32(b, round), 16);
    }
    for (int j = 0; j < 4; j += 2)  // pair rows: K-values k + j, k + j + 1 per channel
      _mm512_store_si512(stage + (2 * q + j / 2) * 32,
                         _mm512_or_si512(bits[j], _mm512_slli_epi32(bits[j + 1], 16)));
  }
}

}  // namespace

void lora_kernels(LoraKernels& k) {
  lora_loops(k);
  k.transpose_tile = transpose_tile;
  lora::set_decoders(k, []<Method M>(std::integral_constant<Method, M>) -> DecodeTileFn {
    if constexpr (!std::is_void_v<typename DecoderFor<M>::type>) {
      return &decode_tile<M>;
    } else {
      return nullptr;
    }
  });
}

}  // namespace kt::kernels::avx512
