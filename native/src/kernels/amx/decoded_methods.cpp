// The AMX GEMMs of the decoded methods with int8 activations (../../methods/decoders.h), one instance each.
#include <cstdint>

#include "../../methods/decoders.h"
#include "qgemm-inl.h"
#include "qgemm_a16-inl.h"

namespace kt::kernels::KT_AMX_NAMESPACE {

KT_Q8_DECODERS(KT_INSTANTIATE_Q8)

}  // namespace kt::kernels::KT_AMX_NAMESPACE
