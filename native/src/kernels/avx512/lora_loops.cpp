// The adapters' fp32 loops (../lora_loops.h) compiled for the AVX-512 family.
#include "../lora_loops.h"

#include "kt/cpu_features.h"
#include "kt/kernels.h"

namespace kt::kernels::avx512 {

void lora_loops(LoraKernels& k) {
  lora::set_fp32_loops<Isa::kAvx512>(k);
}

}  // namespace kt::kernels::avx512
