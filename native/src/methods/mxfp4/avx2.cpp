#include <cstdint>

#include "../../kernels/avx2/qgemm_a16-inl.h"
#include "mxfp4.h"

namespace kt::kernels::avx2 {

void gemm_mxfp4(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
                int64_t ldc) {
  gemm_quant_a16<Method::kMxfp4>(m, K, group, a, panels, npanels, c, ldc);
}

}  // namespace kt::kernels::avx2
