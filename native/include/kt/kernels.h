// The kernel table: one entry per operation, filled once from the chosen ISA (dispatch.cpp), each
// entry falling back to a lower ISA where a family has no version of its own.
#pragma once

#include <cstdint>

#include "kt/cpu_features.h"
#include "kt/quant_types.h"

namespace kt {

// Activation rows as the kernels read them. A row is a sequence of 64-byte K-chunks: chunk c of
// row i starts at row[i] + c * chunk_stride. Plain row-major rows have chunk_stride = 64; the
// engine's gathered layout (rows in blocks of 32, chunk c of the block holding its 32 rows' chunks
// back to back) has chunk_stride = 32 * 64, which AMX loads as tiles without a copy.
inline constexpr int64_t kChunkBytes = 64;
inline constexpr int kRowBlock = 32;
inline constexpr int64_t kTiledChunkStride = kRowBlock * kChunkBytes;

struct Bf16Rows {
  const uint16_t* const* rows;  // m row pointers
  int64_t chunk_stride;
};

// int8 activations quantized per (row, group): a ~= scale * q, scaled_sum = scale * sum(q) over the
// group (it carries the weights' zero points).
struct QuantRows {
  const int8_t* const* rows;  // m row pointers
  int64_t chunk_stride;
  const float* const* scale;  // m row pointers, K / group floats each
  const float* const* scaled_sum;
};

// C[i][j] for rows i < m and channels j < 16 * npanels of the consecutive panels starting at
// `panels` (layout in quant_types.h), K a multiple of the group; written, not accumulated. Every
// method has a bf16-input GEMM ("A16"); the methods whose activations are int8
// (MethodTraits::gate_up_input / down_input) have an int8-input one ("Q8") as well. BF16 ignores
// `group` (its panels have no scales).
using GemmA16Fn = void (*)(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,
                           float* c, int64_t ldc);
using GemmQ8Fn = void (*)(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels,
                          float* c, int64_t ldc);

// The element-wise steps around the GEMMs: h = bf16(silu(gate) * up), y += weight * c, and the
// layer's output out = bf16((accumulate ? out : 0) + parts[0] + ... + parts[nparts - 1]) (the
// pools' partial sums, added in that order on every ISA).
using SiluMulFn = void (*)(const float* gate, const float* up, int64_t n, uint16_t* h);
using AddWeightedFn = void (*)(float* y, const float* c, float weight, int64_t n);
using SumToBf16Fn = void (*)(const float* const* parts, int nparts, int64_t n, bool accumulate,
                             uint16_t* out);

// h = bf16(glu(gate + gate_bias, up + up_bias)) for a GluConfig other than plain silu (moe_layer.h);
// biases may be null. Portable code, vectorized by the compiler per ISA at load (src/glu.cpp).
void glu_general(const float* gate, const float* up, const float* gate_bias, const float* up_bias, int64_t n,
                 int kind, float limit, float alpha, uint16_t* h);

// One method's GEMMs in a table, and which family each comes from (for doctor and tests).
struct MethodKernels {
  GemmQ8Fn gemm_q8 = nullptr;  // null for methods that never read int8 activations
  GemmA16Fn gemm_a16 = nullptr;
  Isa isa_q8 = Isa::kScalar, isa_a16 = Isa::kScalar;
  // Experts of a method with int8 gate/up inputs that have at least this many rows run gate/up
  // through the A16 kernel (bf16 inputs, no per-group epilogue); 0: never (the int8-input kernel is
  // faster at every size).
  int gate_up_a16_min_rows = 0;
  // Experts of a method with an int8 h that have at least this many rows quantize h with one scale
  // per row instead of per group (the AMX INT4 kernel then sums all of K in the tiles); 0: never.
  int down_h_per_row_min_rows = 0;
};

// The fine-tuning kernels (kt/lora.h; src/kernels/<isa>/lora_ops.cpp, lora_loops.cpp). The
// adapters' small fp32 products, row-major with leading dimensions: C += alpha A B^T (gemm_nt,
// A [m, K], B [n, K]), C += alpha A B (gemm_nn, B [K, n]), C += alpha A^T B (gemm_tn, A [K, m]); a
// bf16 row to fp32; silu(g) * u's backward (dg = dh u silu'(g), du = dh silu(g)). And the
// backward's reading of the packed weights transposed (src/kernels/transposed_gemm.h), per 16 x 16
// tile: a method's tile decoded to bf16 rows in BF16's packed layout (8 rows of 16 channels x 2
// K-values), then transposed.
using Fp32GemmFn = void (*)(int64_t m, int64_t n, int64_t K, float alpha, const float* A, int64_t lda,
                            const float* B, int64_t ldb, float* C, int64_t ldc);
using Bf16RowToFloatFn = void (*)(const uint16_t* src, int64_t n, float* dst);
using SiluMulBackwardFn = void (*)(const float* g, const float* u, const float* dh, int64_t n, float* dg,
                                   float* du);
using TransposeTileFn = void (*)(const uint16_t* src, uint16_t* dst);
// Channels 0..15, K-values kin..kin + 15 (kin a multiple of 16 within the group) of the group block
// `g` (quant_types.h).
using DecodeTileFn = void (*)(const uint8_t* g, int group, int kin, uint16_t* stage);

struct LoraKernels {
  Fp32GemmFn gemm_nt, gemm_nn, gemm_tn;
  Bf16RowToFloatFn bf16_row_to_float;
  SiluMulBackwardFn silu_mul_backward;
  TransposeTileFn transpose_tile;
  // Per method: the portable decode in every family, AVX2's and AVX-512's own for the decoded
  // methods (src/methods/decoders.h); null for BF16, whose packed rows are read in place.
  DecodeTileFn decode_tile[kNumMethods];
  Isa isa;  // the family of the fp32 loops and the transpose
};

struct KernelTable {
  Isa isa;
  MethodKernels methods[kNumMethods];
  SiluMulFn silu_mul;
  AddWeightedFn add_weighted;
  SumToBf16Fn sum_to_bf16;
  Isa isa_vector;
  LoraKernels lora;
  const MethodKernels& method(Method m) const { return methods[static_cast<int>(m)]; }
};

// How far ahead (bytes) the AVX-512 and AVX2 quantized kernels prefetch the weights they stream; 0:
// not at all. KT_SGLANG_PREFETCH_BYTES when set (0 to 65536), else 4096 on Intel CPUs and 0 on others:
// on Sapphire Rapids it made Qwen3 INT8 decode 5-9% faster, on Zen 4 every distance tried
// (512 B to 8 KiB) made one core's INT8 / INT4 / BF16 decode stream 1.1-1.8x slower than the
// hardware prefetcher alone. Read once per process; an invalid value throws naming the variable.
int64_t weight_prefetch_bytes();
// weight_prefetch_bytes() in whole groups of `gbytes` (rounded up), 0 for none. On Sapphire Rapids
// the hardware prefetcher alone left INT4 decode at 60% of the read bandwidth, and 4 KiB ahead beat
// 8 groups of INT8 (8.4 KiB per panel, past L1) by 5-9% (both measured with four panels per pass).
// The AVX-512 and AVX2 quantized kernels prefetch into L2 (prefetcht1): on Emerald Rapids, Qwen3
// layer at 1-16 tokens, 2 threads, AVX-512 INT4 decode ran 1.11-1.17x faster than with prefetcht0
// and INT8 1.03-1.07x (AVX2, Q4_K GGUF: 1.08-1.13x); BF16's kernel (0.97x) keeps prefetcht0.
inline int64_t prefetch_distance(int64_t gbytes) {
  return (weight_prefetch_bytes() + gbytes - 1) / gbytes * gbytes;
}

// Table for `isa` (which must be supported by this CPU).
const KernelTable& kernel_table(Isa isa);
// The ISA chosen for this process: best supported, or KT_SGLANG_ISA when set (an unknown or
// unsupported value throws with a message naming the variable).
Isa selected_isa();

namespace kernels {
// Each family's kernels: BF16's (src/methods/bf16/<isa>.cpp), and the GEMMs over a method's decoder
// D (src/kernels/epilogue.h), defined in the family's qgemm*-inl.h and instantiated for the decoders
// of src/methods/decoders.h in its decoded_methods.cpp (AMX: those with int8 activations). FP8
// declares its own in its folder (src/methods/fp8/fp8.h).
#define KT_DECLARE_KERNELS(ns)                                                                       \
  namespace ns {                                                                                     \
  void gemm_bf16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels, \
                 float* c, int64_t ldc);                                                             \
  template <class D>                                                                                 \
  void gemm_q8(int m, int64_t K, int group, const QuantRows& a, const uint8_t* panels, int npanels,  \
               float* c, int64_t ldc);                                                               \
  template <class D>                                                                                 \
  void gemm_a16(int m, int64_t K, int group, const Bf16Rows& a, const uint8_t* panels, int npanels,  \
                float* c, int64_t ldc);                                                              \
  }
KT_DECLARE_KERNELS(scalar)
KT_DECLARE_KERNELS(avx2)
KT_DECLARE_KERNELS(avx512)
KT_DECLARE_KERNELS(amx)
KT_DECLARE_KERNELS(amx_emu)  // the AMX kernels on the tile unit's software model
#undef KT_DECLARE_KERNELS
// AMX INT4 calls of at least this many rows with one activation scale per row requantize their
// panels to int8 with one scale per channel, so that a block of rows sums all of K in the tiles and
// scales once (gemm_whole_k in src/kernels/amx/qgemm-inl.h).
inline constexpr int kAmxWholeKMinRows = 64;
// AMX INT8 calls of at least this many rows with one activation scale per row over panels whose
// channels have one scale over all of K (the directories kt-kernel wrote) sum all of K in the tiles:
// nothing to requantize, so from fewer rows than INT4 (a Qwen3 gate/up call, one core, over the group
// kernel: x1.00-1.03 at 8-16 rows, x1.12 at 32, x1.41 / 2.22 / 2.39 at 64 / 128 / 256).
inline constexpr int kAmxInt8WholeKMinRows = 32;
// Element-wise kernels: AMX adds nothing to them, so the AMX table takes AVX-512's.
#define KT_DECLARE_VECTOR_OPS(ns)                                                                     \
  namespace ns {                                                                                      \
  void silu_mul(const float* gate, const float* up, int64_t n, uint16_t* h);                          \
  void add_weighted(float* y, const float* c, float weight, int64_t n);                               \
  void sum_to_bf16(const float* const* parts, int nparts, int64_t n, bool accumulate, uint16_t* out); \
  }
KT_DECLARE_VECTOR_OPS(scalar)
KT_DECLARE_VECTOR_OPS(avx2)
KT_DECLARE_VECTOR_OPS(avx512)
#undef KT_DECLARE_VECTOR_OPS
// The fine-tuning kernels: each family sets the entries it has its own version of, over the lower
// family's (the scalar family sets every one).
namespace scalar {
void lora_kernels(LoraKernels& k);
}
namespace avx2 {
void lora_kernels(LoraKernels& k);
}
namespace avx512 {
void lora_kernels(LoraKernels& k);
}
}  // namespace kernels

}  // namespace kt
