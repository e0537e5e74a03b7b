// The methods whose kernels are the shared quantized skeletons (src/kernels/<isa>/qgemm*-inl.h)
// instantiated with the method's decoder (src/kernels/epilogue.h): one list, from which every
// kernel family instantiates its GEMMs (src/kernels/<isa>/decoded_methods.cpp) and the registry
// takes their addresses. BF16 and FP8 have kernels of their own (src/methods/<method>/<isa>.cpp).
#pragma once

#include <cstdint>

#include "int4/int4.h"
#include "int4_checkpoint/int4_checkpoint.h"
#include "int8/int8.h"
#include "kt/kernels.h"  // the families' gemm_q8 / gemm_a16 over a decoder
#include "mxfp4/mxfp4.h"
#include "nvfp4/nvfp4.h"

// Methods that read int8 activations: an int8-input GEMM ("Q8") and a bf16-input one ("A16"); the
// AMX family has both for these.
#define KT_Q8_DECODERS(X) X(Int8Decoder) X(Int4Decoder)
// Methods that read bf16 activations only: an A16 GEMM.
#define KT_A16_DECODERS(X) X(RawInt4Decoder) X(GptqInt4Decoder) X(Mxfp4Decoder) X(Nvfp4Decoder)

// A family's instances (in its namespace, after its skeletons): KT_Q8_DECODERS(KT_INSTANTIATE_Q8)
// and, but for AMX, KT_A16_DECODERS(KT_INSTANTIATE_A16).
#define KT_INSTANTIATE_Q8(D)                                                                           \
  template void gemm_q8<D>(int, int64_t, int, const QuantRows&, const uint8_t*, int, float*, int64_t); \
  template void gemm_a16<D>(int, int64_t, int, const Bf16Rows&, const uint8_t*, int, float*, int64_t);
#define KT_INSTANTIATE_A16(D) \
  template void gemm_a16<D>(int, int64_t, int, const Bf16Rows&, const uint8_t*, int, float*, int64_t);

namespace kt {

// The decoder of a method, for code that holds a Method (void: the method has kernels of its own).
template <Method M>
struct DecoderFor {
  using type = void;
};
#define KT_DECODER_FOR(D)         \
  template <>                     \
  struct DecoderFor<D::kMethod> { \
    using type = D;               \
  };
KT_Q8_DECODERS(KT_DECODER_FOR)
KT_A16_DECODERS(KT_DECODER_FOR)
#undef KT_DECODER_FOR

#define KT_HAS_INT8_INPUT(D) static_assert(D::Codes::kInt8Input, #D "'s codes have no int8-input kernel");
KT_Q8_DECODERS(KT_HAS_INT8_INPUT)
#undef KT_HAS_INT8_INPUT

}  // namespace kt
