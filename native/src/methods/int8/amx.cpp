#include <cstdint>

#include "../../kernels/amx/qgemm-inl.h"
#include "../../kernels/amx/qgemm_a16-inl.h"

namespace kt::kernels::KT_AMX_NAMESPACE {

void gemm_int8(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels, float* c,
               int64_t ldc) {
  gemm_quant<Method::kInt8>(m, K, group, a, panels, npanels, c, ldc, avx512::gemm_int8);
}

void gemm_int8_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                   float* c, int64_t ldc) {
  gemm_quant_a16<Method::kInt8>(m, K, group, a, panels, npanels, c, ldc, avx512::gemm_int8_a16);
}

}  // namespace kt::kernels::KT_AMX_NAMESPACE
