// The adapters' fp32 loops (../lora_loops.h) compiled for the AVX2 family.
#include "../lora_loops.h"

#include "kt/cpu_features.h"
#include "kt/kernels.h"

namespace kt::kernels::avx2 {

void lora_loops(LoraKernels& k) {
  lora::set_fp32_loops<Isa::kAvx2>(k);
}

}  // namespace kt::kernels::avx2
