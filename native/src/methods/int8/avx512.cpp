#include <cstdint>

#include "../../kernels/avx512/qgemm-inl.h"
#include "../../kernels/avx512/qgemm_a16-inl.h"

namespace kt::kernels::avx512 {

void gemm_int8(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  gemm_quant<Method::kInt8>(m, K, group, a, panels, npanels, c, ldc);
}

void gemm_int8_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                   float* c, int64_t ldc) {
  gemm_quant_a16<Method::kInt8>(m, K, group, a, panels, npanels, c, ldc);
}

}  // namespace kt::kernels::avx512
