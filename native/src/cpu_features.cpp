// ref: Intel SDM Vol. 2A, CPUID leaf 07H; Vol. 1 13.3 (XCR0); Linux Documentation/arch/x86/xstate.rst
#include "kt/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace kt {

namespace {

constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

uint64_t read_xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool bit(uint32_t reg, int b) {
  return (reg >> b) & 1u;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  char brand[49] = {};
  if (__get_cpuid_max(0x80000000u, nullptr) >= 0x80000004u) {
    for (unsigned i = 0; i < 3; ++i) {
      __cpuid(0x80000002u + i, a, b, c, d);
      std::memcpy(brand + 16 * i, &a, 4), std::memcpy(brand + 16 * i + 4, &b, 4);
      std::memcpy(brand + 16 * i + 8, &c, 4), std::memcpy(brand + 16 * i + 12, &d, 4);
    }
  }
  f.brand = brand;
  while (!f.brand.empty() && f.brand.front() == ' ') f.brand.erase(f.brand.begin());

  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  {
    char vendor[13] = {};
    __cpuid(0, a, b, c, d);
    std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
    f.vendor = vendor;
  }
  if (max_leaf < 7) return f;
  __cpuid_count(1, 0, a, b, c, d);
  const bool osxsave = bit(c, 27);
  f.fma = bit(c, 12);
  f.f16c = bit(c, 29);
  const bool avx = bit(c, 28);
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = bit(b, 5);
  f.avx512f = bit(b, 16), f.avx512dq = bit(b, 17), f.avx512bw = bit(b, 30), f.avx512vl = bit(b, 31);
  f.avx512_vbmi = bit(c, 1), f.avx512_vnni = bit(c, 11);
  f.amx_bf16 = bit(d, 22), f.amx_tile = bit(d, 24), f.amx_int8 = bit(d, 25);
  const unsigned subleaves = a;
  if (subleaves >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = bit(a, 5);
  }
  if (osxsave && avx) {
    const uint64_t xcr0 = read_xcr0();
    f.os_avx = (xcr0 & 0x6) == 0x6;
    f.os_avx512 = f.os_avx && (xcr0 & 0xe0) == 0xe0;
    f.os_amx = f.os_avx512 && (xcr0 & 0x60000) == 0x60000;
  }
  if (f.amx_tile && f.os_amx) {
    // The kernel hands out the 8 KiB tile state only to processes that ask for it.
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0) {
      unsigned long mask = 0;
      f.amx_permitted =
          syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) == 0 && (mask & (1ul << kXfeatureXtiledata));
      if (!f.amx_permitted) f.amx_permission_error = "ARCH_GET_XCOMP_PERM lacks XTILEDATA";
    } else {
      f.amx_permission_error = std::string("arch_prctl(ARCH_REQ_XCOMP_PERM) failed: ") + std::strerror(errno);
    }
  } else if (f.amx_tile) {
    f.amx_permission_error = "the OS does not enable AMX tile state (XCR0 bits 17-18)";
  }
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAmx:
      return "amx";
    case Isa::kAmxEmu:
      return "amx-emu";
  }
  return "?";
}

std::optional<Isa> parse_isa(std::string_view name) {
  for (Isa isa : kAllIsas)
    if (name == isa_name(isa)) return isa;
  return std::nullopt;
}

bool isa_supported(Isa isa) {
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.os_avx && f.avx2 && f.fma && f.f16c;
  const bool avx512 = avx2 && f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return avx2;
    case Isa::kAvx512:
      return avx512;
    case Isa::kAmx:
      return avx512 && f.avx512_vnni && f.avx512_bf16 && f.avx512_vbmi && f.amx_tile && f.amx_int8 &&
             f.amx_bf16 && f.amx_permitted;
    case Isa::kAmxEmu:  // what the AMX kernels use besides the tile unit
      return avx512 && f.avx512_vnni && f.avx512_bf16 && f.avx512_vbmi;
  }
  return false;
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : kAllIsas)
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

Isa best_isa() {
  Isa best = Isa::kScalar;
  for (Isa isa : supported_isas())
    if (isa != Isa::kAmxEmu) best = isa;
  return best;
}

}  // namespace kt
