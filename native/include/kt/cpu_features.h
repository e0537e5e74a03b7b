// Run-time CPU feature detection and the instruction-set paths (ISAs) the engine can take.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kt {

// Kernel families, lowest to highest. Every ISA falls back to the next lower one per kernel.
// kAmxEmu is the AMX kernels compiled against the software model of the tile unit
// (src/kernels/amx/tile_model.h) over AVX-512: chosen only by name (KT_SGLANG_ISA, tests), never
// as the best ISA; it ranks above kAmx so that `isa >= kAvx512` / `>= kAmx` tests treat it as AMX.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3, kAmxEmu = 4 };
inline constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx, Isa::kAmxEmu};

const char* isa_name(Isa isa);
std::optional<Isa> parse_isa(std::string_view name);

struct CpuFeatures {
  std::string vendor;  // CPUID leaf 0: "GenuineIntel", "AuthenticAMD", ...
  std::string brand;
  // CPUID bits.
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_vnni = false, avx512_bf16 = false, avx512_vbmi = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  // What the OS enables (XCR0) and grants (AMX tile data needs arch_prctl permission).
  bool os_avx = false, os_avx512 = false, os_amx = false;
  bool amx_permitted = false;
  std::string amx_permission_error;  // why permission was refused, when it was
};

// Detected once per process; the first call asks the kernel for AMX permission.
const CpuFeatures& cpu_features();

bool isa_supported(Isa isa);
std::vector<Isa> supported_isas();
Isa best_isa();

}  // namespace kt
