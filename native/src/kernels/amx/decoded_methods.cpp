// The AMX GEMMs of the methods that read int8 activations (../../methods/decoders.h), one instance
// per decoder; small batches go to the AVX-512 ones.
#include <cstdint>

#include "../../methods/decoders.h"
#include "qgemm-inl.h"
#include "qgemm_a16-inl.h"

namespace kt::kernels::KT_AMX_NAMESPACE {

template <class D>
void gemm_q8(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
             int64_t ldc) {
  gemm_quant<D>(m, K, group, a, panels, npanels, c, ldc, avx512::gemm_q8<D>);
}

template <class D>
void gemm_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
              int64_t ldc) {
  gemm_quant_a16<D>(m, K, group, a, panels, npanels, c, ldc, avx512::gemm_a16<D>);
}

#define KT_INSTANTIATE_Q8(D)                                                                           \
  template void gemm_q8<D>(int, int64_t, int, const QuantRows&, const uint8_t*, int, float*, int64_t); \
  template void gemm_a16<D>(int, int64_t, int, const Bf16Rows&, const uint8_t*, int, float*, int64_t);
#define KT_INSTANTIATE_A16(D) \
  template void gemm_a16<D>(int, int64_t, int, const Bf16Rows&, const uint8_t*, int, float*, int64_t);
KT_Q8_DECODERS(KT_INSTANTIATE_Q8)
#undef KT_INSTANTIATE_Q8
#undef KT_INSTANTIATE_A16

}  // namespace kt::kernels::KT_AMX_NAMESPACE
