#include <cstdint>

#include "../../kernels/scalar/qgemm_a16-inl.h"
#include "nvfp4.h"

namespace kt::kernels::scalar {

void gemm_nvfp4(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
                int64_t ldc) {
  gemm_quant_a16<Method::kNvfp4>(m, K, group, a, panels, npanels, c, ldc);
}

}  // namespace kt::kernels::scalar
