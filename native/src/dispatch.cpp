// One kernel table per ISA, filled once. An entry a family lacks (or a feature the CPU lacks within
// that family, e.g. AVX-512 without VNNI) falls back to the next lower family.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kt/env.h"
#include "kt/kernels.h"
#include "methods/registry.h"

namespace kt {

namespace {

KernelTable make_table(Isa isa) {
  const CpuFeatures& f = cpu_features();
  KernelTable t{};
  t.isa = isa;
  // Each method's kernels from the highest family up to `isa` that has its own (kernel_rows in
  // ascending ISA order per method).
  for (const KernelRow& row : kernel_rows()) {
    if (row.isa > isa || !row.usable(f)) continue;
    if (isa == Isa::kAmxEmu && row.isa == Isa::kAmx) continue;  // the modelled kernels instead
    MethodKernels& k = t.methods[static_cast<int>(row.method)];
    if (row.gemm_q8) k.gemm_q8 = row.gemm_q8, k.isa_q8 = row.isa;
    if (row.gemm_a16) k.gemm_a16 = row.gemm_a16, k.isa_a16 = row.isa;
  }
  t.silu_mul = kernels::scalar::silu_mul, t.add_weighted = kernels::scalar::add_weighted;
  t.sum_to_bf16 = kernels::scalar::sum_to_bf16, t.isa_vector = Isa::kScalar;
  if (isa >= Isa::kAvx2) {
    t.silu_mul = kernels::avx2::silu_mul, t.add_weighted = kernels::avx2::add_weighted;
    t.sum_to_bf16 = kernels::avx2::sum_to_bf16, t.isa_vector = Isa::kAvx2;
  }
  if (isa >= Isa::kAvx512) {
    t.silu_mul = kernels::avx512::silu_mul, t.add_weighted = kernels::avx512::add_weighted;
    t.sum_to_bf16 = kernels::avx512::sum_to_bf16, t.isa_vector = Isa::kAvx512;
  }
  kernels::scalar::lora_kernels(t.lora);
  if (isa >= Isa::kAvx2) kernels::avx2::lora_kernels(t.lora);
  if (isa >= Isa::kAvx512) kernels::avx512::lora_kernels(t.lora);
  // A16 gate/up over the int8-input kernel, whole layer: DeepSeek at 2048 tokens (256 rows per
  // expert, K 7168) INT8 x0.98-1.02; at 512 tokens (64 rows) x0.92; Qwen3 at 2048 tokens (128 rows)
  // x0.95-1.04. Hence INT8's A16 only from 160 rows. INT4's int8-input kernel sums all of K in the
  // tiles from 64 rows (amx/qgemm-inl.h) and is the faster at every size (Qwen3 at 4096 tokens, 256
  // rows per expert: x1.13-1.23 without A16).
  if (isa >= Isa::kAmx) t.methods[static_cast<int>(Method::kInt8)].gate_up_a16_min_rows = 160;
  // INT4's down projection with h quantized per group runs the group kernel (an epilogue per
  // group); with one scale per row, from kernels::kAmxWholeKMinRows rows, the whole-K kernel. One
  // core, interleaved, whole-K over the A16 kernel (h in bf16, weights dequantized per call), 64 /
  // 128 / 256 rows: Qwen3 down (K 768, 2048 channels) x1.63 / 1.74 / 1.62, DeepSeek down (K 2048,
  // 7168 channels) x1.97 / 1.78 / 1.80.
  if (isa >= Isa::kAmx)
    t.methods[static_cast<int>(Method::kInt4)].down_h_per_row_min_rows = kernels::kAmxWholeKMinRows;
  for (const auto& m : kMethodTable) {
    const MethodKernels& k = t.method(m.method);
    const bool needs_q8 = m.gate_up_input == Activation::kInt8 || m.down_input == Activation::kInt8;
    if (!k.gemm_a16 || (needs_q8 && !k.gemm_q8))
      throw std::logic_error(std::string("method ") + m.name + " has no scalar kernel registered");
  }
  return t;
}

}  // namespace

const KernelTable& kernel_table(Isa isa) {
  static const KernelTable tables[] = {make_table(Isa::kScalar), make_table(Isa::kAvx2),
                                       make_table(Isa::kAvx512), make_table(Isa::kAmx),
                                       make_table(Isa::kAmxEmu)};
  if (!isa_supported(isa))
    throw std::invalid_argument(std::string("this CPU cannot run the '") + isa_name(isa) + "' kernels");
  return tables[static_cast<int>(isa)];
}

int64_t weight_prefetch_bytes() {
  static const int64_t bytes =
      env_integer("KT_SGLANG_PREFETCH_BYTES", cpu_features().vendor == "GenuineIntel" ? 4096 : 0, 0, 65536,
                  "a byte count (0: no prefetch)");
  return bytes;
}

Isa selected_isa() {
  const char* env = std::getenv("KT_SGLANG_ISA");
  if (!env || !*env) return best_isa();
  const auto isa = parse_isa(env);
  if (!isa) {
    std::string names;
    for (Isa known : kAllIsas) names += (names.empty() ? "" : ", ") + std::string(isa_name(known));
    throw std::invalid_argument(std::string("KT_SGLANG_ISA='") + env + "' is not an ISA path: use one of " +
                                names);
  }
  if (!isa_supported(*isa))
    throw std::invalid_argument(std::string("KT_SGLANG_ISA='") + env +
                                "' asks for a path this CPU cannot run (best here: " + isa_name(best_isa()) +
                                ")");
  return *isa;
}

}  // namespace kt
