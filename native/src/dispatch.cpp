// One kernel table per ISA, filled once. An entry a family lacks (or a feature the CPU lacks within
// that family, e.g. AVX-512 without VNNI) falls back to the next lower family.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kt/kernels.h"

namespace kt {

namespace {

KernelTable make_table(Isa isa) {
  const CpuFeatures& f = cpu_features();
  KernelTable t{Isa::kScalar,
                kernels::scalar::gemm_bf16,
                kernels::scalar::gemm_int8,
                kernels::scalar::gemm_int4,
                kernels::scalar::gemm_int8_a16,
                kernels::scalar::gemm_int4_a16,
                kernels::scalar::silu_mul,
                kernels::scalar::add_weighted,
                kernels::scalar::sum_to_bf16,
                0,
                Isa::kScalar,
                Isa::kScalar,
                Isa::kScalar,
                Isa::kScalar,
                Isa::kScalar};
  t.isa = isa;
  if (isa >= Isa::kAvx2) {
    t.gemm_bf16 = kernels::avx2::gemm_bf16, t.isa_bf16 = Isa::kAvx2;
    t.gemm_int8 = kernels::avx2::gemm_int8, t.isa_int8 = Isa::kAvx2;
    t.gemm_int4 = kernels::avx2::gemm_int4, t.isa_int4 = Isa::kAvx2;
    t.gemm_int8_a16 = kernels::avx2::gemm_int8_a16, t.gemm_int4_a16 = kernels::avx2::gemm_int4_a16;
    t.isa_a16 = Isa::kAvx2;
    t.silu_mul = kernels::avx2::silu_mul, t.add_weighted = kernels::avx2::add_weighted;
    t.sum_to_bf16 = kernels::avx2::sum_to_bf16;
    t.isa_vector = Isa::kAvx2;
  }
  if (isa >= Isa::kAvx512) {
    t.silu_mul = kernels::avx512::silu_mul, t.add_weighted = kernels::avx512::add_weighted;
    t.sum_to_bf16 = kernels::avx512::sum_to_bf16;
    t.isa_vector = Isa::kAvx512;
    if (f.avx512_bf16) t.gemm_bf16 = kernels::avx512::gemm_bf16, t.isa_bf16 = Isa::kAvx512;
    if (f.avx512_vnni) {
      t.gemm_int8 = kernels::avx512::gemm_int8, t.isa_int8 = Isa::kAvx512;
      t.gemm_int4 = kernels::avx512::gemm_int4, t.isa_int4 = Isa::kAvx512;
      t.gemm_int8_a16 = kernels::avx512::gemm_int8_a16, t.gemm_int4_a16 = kernels::avx512::gemm_int4_a16;
      t.isa_a16 = Isa::kAvx512;
    }
  }
  if (isa >= Isa::kAmx) {
    t.gemm_bf16 = kernels::amx::gemm_bf16, t.isa_bf16 = Isa::kAmx;
    t.gemm_int8 = kernels::amx::gemm_int8, t.isa_int8 = Isa::kAmx;
    t.gemm_int4 = kernels::amx::gemm_int4, t.isa_int4 = Isa::kAmx;
    t.gemm_int8_a16 = kernels::amx::gemm_int8_a16, t.gemm_int4_a16 = kernels::amx::gemm_int4_a16;
    t.isa_a16 = Isa::kAmx;
    // Measured on the layer at 2048 tokens: DeepSeek (256 rows per expert, K 7168) x1.27-1.36,
    // and since the int8 kernel's scratch pointer INT8 x0.98-1.02, INT4 x1.04-1.09; at 64 rows
    // x0.92 and at Qwen3's 128 rows x0.95-1.04, so only from 160 rows.
    t.gate_up_a16_min_rows = 160;
  }
  return t;
}

}  // namespace

const KernelTable& kernel_table(Isa isa) {
  static const KernelTable tables[] = {make_table(Isa::kScalar), make_table(Isa::kAvx2),
                                       make_table(Isa::kAvx512), make_table(Isa::kAmx)};
  if (!isa_supported(isa))
    throw std::invalid_argument(std::string("this CPU cannot run the '") + isa_name(isa) + "' kernels");
  return tables[static_cast<int>(isa)];
}

int64_t weight_prefetch_bytes() {
  static const int64_t bytes = [] {
    const char* env = std::getenv("KT_SGLANG_PREFETCH_BYTES");
    if (!env || !*env) return int64_t{cpu_features().vendor == "GenuineIntel" ? 4096 : 0};
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    if (*end != '\0' || v < 0 || v > 65536)
      throw std::invalid_argument(std::string("KT_SGLANG_PREFETCH_BYTES='") + env +
                                  "' is not a byte count: use 0 (no prefetch) to 65536");
    return static_cast<int64_t>(v);
  }();
  return bytes;
}

Isa selected_isa() {
  const char* env = std::getenv("KT_SGLANG_ISA");
  if (!env || !*env) return best_isa();
  const auto isa = parse_isa(env);
  if (!isa)
    throw std::invalid_argument(std::string("KT_SGLANG_ISA='") + env +
                                "' is not an ISA path: use scalar, avx2, avx512 or amx");
  if (!isa_supported(*isa))
    throw std::invalid_argument(std::string("KT_SGLANG_ISA='") + env +
                                "' asks for a path this CPU cannot run (best here: " + isa_name(best_isa()) +
                                ")");
  return *isa;
}

}  // namespace kt
