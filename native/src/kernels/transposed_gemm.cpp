#include "kernels/transposed_gemm.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "kt/aligned_vector.h"
#include "kt/thread_scratch.h"

namespace kt {

namespace {

// Columns [k0, k0 + 64) of W [N, K] (packed panels) as 4 bf16 panels of W^T in BF16's packed layout
// (16 output channels x pairs of reduction values per 64-byte row), reduction padded to Nr (a
// multiple of 64) with zeros. Tile by tile of 16 x 16: BF16's packed rows are read in place, other
// methods' weights are decoded to bf16 rows first (one rounding of scale * value).
template <Method M>
void decode_transposed(const uint8_t* panels, int group, int64_t N, int64_t K, int64_t k0, int64_t Nr,
                       const LoraKernels& k, uint16_t* wt) {
  const TransposeTileFn transpose = k.transpose_tile;
  const DecodeTileFn decode = k.decode_tile[static_cast<int>(M)];
  const int64_t pbytes = panel_bytes(M, group, K), gbytes = group_bytes(M, group);
  const int64_t panel_t = Nr * kPanelWidth;  // bf16 values per panel of W^T
  alignas(64) uint16_t stage[8 * 32];
  for (int64_t p = 0; p < N / kPanelWidth; ++p) {
    const uint8_t* panel = panels + p * pbytes;
    // W^T's rows for reduction values 16p..16p + 15: 8 rows of 32 bf16 in group (16p) / 64
    uint16_t* dst = wt + (p / 4) * 64 * kPanelWidth + (p % 4) * 8 * 32;
    for (int t = 0; t < kTransposedBlock / kPanelWidth; ++t) {
      const int64_t k = k0 + t * kPanelWidth;
      const uint8_t* g = panel + (k / group) * gbytes;
      const int kin = static_cast<int>(k % group);
      const uint16_t* src = stage;
      if constexpr (M == Method::kBf16) {
        src = reinterpret_cast<const uint16_t*>(g) + (kin / 2) * 32;
      } else {
        decode(g, group, kin, stage);
      }
      transpose(src, dst + t * panel_t);
    }
  }
  for (int j = 0; j < kTransposedBlock / kPanelWidth; ++j)  // the reduction's zero padding
    std::fill(wt + j * panel_t + N * kPanelWidth, wt + (j + 1) * panel_t, uint16_t{0});
}

using DecodeTransposedFn = void (*)(const uint8_t*, int, int64_t, int64_t, int64_t, int64_t,
                                    const LoraKernels&, uint16_t*);

template <int... Ms>
constexpr auto make_decoders(std::integer_sequence<int, Ms...>) {
  return std::array<DecodeTransposedFn, sizeof...(Ms)>{&decode_transposed<static_cast<Method>(Ms)>...};
}
constexpr auto kDecoders = make_decoders(std::make_integer_sequence<int, kNumMethods>{});

}  // namespace

void gemm_transposed(const KernelTable& table, Method method, int group, const uint8_t* panels, int64_t N,
                     int64_t K, int64_t k0, int m, const uint16_t* const* rows, float* c, int64_t ldc) {
  struct Decoded {
    AlignedVector<uint16_t> wt;
  };
  auto& sc = *thread_scratch<Decoded>();
  const int64_t Nr = round_up(N, kKAlign);
  if (sc.wt.size() < static_cast<size_t>(Nr * kTransposedBlock)) sc.wt.resize(Nr * kTransposedBlock);
  kDecoders[static_cast<int>(method)](panels, group, N, K, k0, Nr, table.lora, sc.wt.data());
  const Bf16Rows a{rows, kChunkBytes};
  table.method(Method::kBf16)
      .gemm_a16(m, Nr, kKAlign, a, reinterpret_cast<const uint8_t*>(sc.wt.data()),
                static_cast<int>(kTransposedBlock / kPanelWidth), c, ldc);
}

}  // namespace kt
