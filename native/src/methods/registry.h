// What each method contributes besides its row of kMethodTable (kt/quant_types.h): its packing and
// quantization functions, and its kernels per ISA family. dispatch.cpp builds the kernel tables from
// kernel_rows(); packing.cpp and quantize.cpp call method_ops().
#pragma once

#include <cstdint>
#include <span>

#include "kt/cpu_features.h"
#include "kt/kernels.h"
#include "kt/packing.h"
#include "kt/quantize.h"

namespace kt {

struct MethodOps {
  Method method;
  // Group `gi` of the panel whose first channel is packed row n0 of `region`, into `dst`
  // (group_bytes(method, group) long); anything past the source is zero.
  void (*pack_group)(const CanonicalMatrix& src, const PackRegion& region, int64_t n0, int64_t gi,
                     uint8_t* dst);
  // Rows [row_begin, row_end) of a dense [N, K] matrix of `dtype` into `dst` (quantizes_dense only).
  void (*quantize_rows)(const void* src, DType dtype, CanonicalMatrix& dst, int64_t row_begin,
                        int64_t row_end);
};
const MethodOps& method_ops(Method m);

// A method's own kernels in one ISA family, used where `usable` says the CPU runs them; a family
// without a row (or an unusable one) takes the next lower family's kernels.
struct KernelRow {
  Method method;
  Isa isa;
  bool (*usable)(const CpuFeatures&);
  GemmQ8Fn gemm_q8;  // null for methods without int8 activations
  GemmA16Fn gemm_a16;
};
std::span<const KernelRow> kernel_rows();

// The BF16 / INT8 / INT4 packing and quantization (packing.cpp, quantize.cpp).
void pack_group_bf16(const CanonicalMatrix&, const PackRegion&, int64_t n0, int64_t gi, uint8_t* dst);
void pack_group_int8(const CanonicalMatrix&, const PackRegion&, int64_t n0, int64_t gi, uint8_t* dst);
void pack_group_int4(const CanonicalMatrix&, const PackRegion&, int64_t n0, int64_t gi, uint8_t* dst);
// The weight block of an INT4-layout group (quant_types.h) from a canonical nibble weight.
void pack_nibbles(const CanonicalMatrix&, const PackRegion&, int64_t n0, int64_t gi, uint8_t* dst);

// Entry of a per-(row, group) table of T (a canonical [N, groups] tensor) for packed row `row` of
// `region` and its packed group `gi`; 0 outside the source.
template <typename T>
T group_table_entry(const CanonicalMatrix& m, const PackRegion& region, const void* table, int64_t row,
                    int64_t gi) {
  const int64_t src_row = region.row_offset + row, src_group = region.col_offset / m.group + gi;
  if (src_row >= m.N || src_group >= m.num_groups()) return T{0};
  return static_cast<const T*>(table)[src_row * m.num_groups() + src_group];
}
void quantize_rows_rowwise(const void* src, DType dtype, CanonicalMatrix& dst, int64_t row_begin,
                           int64_t row_end);

}  // namespace kt
