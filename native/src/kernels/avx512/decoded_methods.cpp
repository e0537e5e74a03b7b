// The AVX-512 GEMMs of the decoded methods (../../methods/decoders.h), one instance per decoder:
// the methods that read bf16 activations only take the decoded tiles for prefill.
#include <cstdint>

#include "../../methods/decoders.h"
#include "decoded_prefill-inl.h"
#include "qgemm-inl.h"
#include "qgemm_a16-inl.h"

namespace kt::kernels::avx512 {

template <class D>
void gemm_q8(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
             int64_t ldc) {
  gemm_quant<D>(m, K, group, a, panels, npanels, c, ldc);
}

template <class D>
void gemm_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  if constexpr (method_traits(D::kMethod).gate_up_input == Activation::kBf16)
    gemm_nibbles_a16<D>(m, K, group, a, panels, npanels, c, ldc);
  else
    gemm_quant_a16<D>(m, K, group, a, panels, npanels, c, ldc);
}

#define KT_INSTANTIATE_Q8(D)                                                                           \
  template void gemm_q8<D>(int, int64_t, int, const QuantRows&, const uint8_t*, int, float*, int64_t); \
  template void gemm_a16<D>(int, int64_t, int, const Bf16Rows&, const uint8_t*, int, float*, int64_t);
#define KT_INSTANTIATE_A16(D) \
  template void gemm_a16<D>(int, int64_t, int, const Bf16Rows&, const uint8_t*, int, float*, int64_t);
KT_Q8_DECODERS(KT_INSTANTIATE_Q8)
KT_A16_DECODERS(KT_INSTANTIATE_A16)
#undef KT_INSTANTIATE_Q8
#undef KT_INSTANTIATE_A16

}  // namespace kt::kernels::avx512
