// The portable GEMMs of every decoded method (../../methods/decoders.h), one instance each.
#include <cstdint>

#include "../../methods/decoders.h"
#include "qgemm-inl.h"
#include "qgemm_a16-inl.h"

namespace kt::kernels::scalar {

KT_Q8_DECODERS(KT_INSTANTIATE_Q8)
KT_A16_DECODERS(KT_INSTANTIATE_A16)

}  // namespace kt::kernels::scalar
