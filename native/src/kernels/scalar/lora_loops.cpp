// The adapters' fp32 loops (../lora_loops.h) compiled for the portable family.
#include "../lora_loops.h"

#include "kt/cpu_features.h"
#include "kt/kernels.h"

namespace kt::kernels::scalar {

void lora_loops(LoraKernels& k) {
  lora::set_fp32_loops<Isa::kScalar>(k);
}

}  // namespace kt::kernels::scalar
