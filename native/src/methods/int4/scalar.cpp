#include <cstdint>

#include "../../kernels/scalar/qgemm-inl.h"
#include "../../kernels/scalar/qgemm_a16-inl.h"

namespace kt::kernels::scalar {

void gemm_int4(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  gemm_quant<Method::kInt4>(m, K, group, a, panels, npanels, c, ldc);
}

void gemm_int4_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                   float* c, int64_t ldc) {
  gemm_quant_a16<Method::kInt4>(m, K, group, a, panels, npanels, c, ldc);
}

}  // namespace kt::kernels::scalar
