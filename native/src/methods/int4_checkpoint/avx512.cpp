#include <cstdint>

#include "../../kernels/avx512/decoded_prefill-inl.h"
#include "int4_checkpoint.h"

namespace kt::kernels::avx512 {

void gemm_rawint4(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                  float* c, int64_t ldc) {
  gemm_nibbles_a16<Method::kRawInt4>(m, K, group, a, panels, npanels, c, ldc);
}

void gemm_gptq(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  gemm_nibbles_a16<Method::kGptqInt4>(m, K, group, a, panels, npanels, c, ldc);
}

}  // namespace kt::kernels::avx512
