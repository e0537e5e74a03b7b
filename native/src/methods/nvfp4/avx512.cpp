#include <cstdint>

#include "../../kernels/avx512/decoded_prefill-inl.h"
#include "nvfp4.h"

namespace kt::kernels::avx512 {

void gemm_nvfp4(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, float* c,
                int64_t ldc) {
  gemm_nibbles_a16<Method::kNvfp4>(m, K, group, a, panels, npanels, c, ldc);
}

}  // namespace kt::kernels::avx512
