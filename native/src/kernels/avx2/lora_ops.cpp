// The fine-tuning kernels of the AVX2 family (kt/kernels.h, LoraKernels): the adapters' fp32 loops
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

namespace kt::kernels::avx2 {

namespace {

// The scalar transpose_tile (../scalar/lora_ops.cpp) with AVX2: in each 8-byte unit (2 channels x 2
// K-values) swap the middle values, then transpose the 8 x 8 units as four 4 x 4 blocks (unpack
// pairs of rows, then swap 128-bit halves).
void transpose_tile(const uint16_t* src, uint16_t* dst) {
  const __m256i swap = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2,
                                        3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  for (int a = 0; a < 2; ++a)      // rows 4a..4a + 3 of src: units 4a..4a + 3 of each dst row
    for (int b = 0; b < 2; ++b) {  // units 4b..4b + 3 of src rows: dst rows 4b..4b + 3
      __m256i r[4];
      for (int i = 0; i < 4; ++i)
        r[i] = _mm256_shuffle_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (4 * a + i) * 32 + 16 * b)), swap);
      const __m256i t0 = _mm256_unpacklo_epi64(r[0], r[1]), t1 = _mm256_unpackhi_epi64(r[0], r[1]),
                    t2 = _mm256_unpacklo_epi64(r[2], r[3]), t3 = _mm256_unpackhi_epi64(r[2], r[3]);
      const __m256i out[4] = {
          _mm256_permute2x128_si256(t0, t2, 0x20), _mm256_permute2x128_si256(t1, t3, 0x20),
          _mm256_permute2x128_si256(t0, t2, 0x31), _mm256_permute2x128_si256(t1, t3, 0x31)};
      for (int j = 0; j < 4; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (4 * b + j) * 32 + 16 * a), out[j]);
    }
}

// The scalar decode_tile for the decoded methods (methods/decoders.h) with AVX2, 8 channels a
// vector: per packed row of 4 K-values, each value = value(code) * scale + offset (../codes.h),
// rounded to bf16 (to nearest even).
template <Method M>
void decode_tile(const uint8_t* g, int group, int kin, uint16_t* stage) {
  using D = typename DecoderFor<M>::type;
  using C = typename D::Codes;
  const uint8_t* block = g + group_weight_bytes(M, group);
  alignas(32) float scale[kPanelWidth], offset[kPanelWidth];
  for (int n = 0; n < kPanelWidth; ++n) {
    const auto [s, o] = D::template scales<scalar::Lanes>(block, n);
    scale[n] = s;
    offset[n] = value_offset<C>(o);
  }
  const CodeLanes<C> codes;
  for (int q = 0; q < 4; ++q) {
    const RowPart at = row_part<C>(group, (kin + 4 * q) / 4);  // K-values kin + 4q .. + 3
    for (int h = 0; h < 2; ++h) {                              // channels 8h..8h + 7
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + at.row * 64 + 32 * h));
      const __m256 vs = _mm256_load_ps(scale + 8 * h), vo = _mm256_load_ps(offset + 8 * h);
      __m256i bits[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 value = codes.lane_value(codes.lane_code(v, 8 * j + C::kBits * at.part));
        const __m256i b = _mm256_castps_si256(_mm256_fmadd_ps(value, vs, vo));
        const __m256i round = _mm256_add_epi32(
            _mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)));
        bits[j] = _mm256_srli_epi32(_mm256_add_epi32(b, round), 16);
      }
      for (int j = 0; j < 4; j += 2)  // pair rows: K-values k + j, k + j + 1 per channel
        _mm256_store_si256(reinterpret_cast<__m256i*>(stage + (2 * q + j / 2) * 32 + 16 * h),
                           _mm256_or_si256(bits[j], _mm256_slli_epi32(bits[j + 1], 16)));
    }
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

}  // namespace kt::kernels::avx2
