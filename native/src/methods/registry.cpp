// The functions behind each row of kMethodTable: one MethodOps per method, and one KernelRow per
// method and ISA family that has kernels of its own.
#include "registry.h"

#include <cctype>
#include <stdexcept>
#include <string>

#include "decoders.h"
#include "fp8/fp8.h"

namespace kt {

namespace {

bool always(const CpuFeatures&) {
  return true;
}
bool has_avx512_bf16(const CpuFeatures& f) {
  return f.avx512_bf16;
}
bool has_avx512_vnni(const CpuFeatures& f) {
  return f.avx512_vnni;
}
bool has_avx512_bf16_vbmi(const CpuFeatures& f) {
  return f.avx512_bf16 && f.avx512_vbmi;
}

constexpr MethodOps kOps[kNumMethods] = {
    {.method = Method::kBf16, .pack_group = pack_group_bf16, .quantize_rows = quantize_rows_rowwise},
    {.method = Method::kInt8, .pack_group = pack_group_int8, .quantize_rows = quantize_rows_rowwise},
    {.method = Method::kInt4, .pack_group = pack_group_int4, .quantize_rows = quantize_rows_rowwise},
    {.method = Method::kFp8, .pack_group = fp8::pack_group, .quantize_rows = fp8::quantize_rows},
    {.method = Method::kFp8PerChannel, .pack_group = fp8::pack_group, .quantize_rows = fp8::quantize_rows},
    {.method = Method::kRawInt4, .pack_group = int4_checkpoint::pack_group_rawint4, .quantize_rows = nullptr},
    {.method = Method::kGptqInt4, .pack_group = int4_checkpoint::pack_group_gptq, .quantize_rows = nullptr},
    {.method = Method::kMxfp4, .pack_group = mxfp4::pack_group, .quantize_rows = nullptr},
    {.method = Method::kNvfp4, .pack_group = nvfp4::pack_group, .quantize_rows = nullptr},
};
constexpr bool ops_follow_enum() {
  for (int i = 0; i < kNumMethods; ++i)
    if (static_cast<int>(kOps[i].method) != i) return false;
  return true;
}
static_assert(ops_follow_enum(), "kOps' rows must follow Method's order");

// Per method in ascending ISA order: a higher family's row replaces a lower one's where usable.
namespace k = kernels;
constexpr KernelRow kKernels[] = {
    {Method::kBf16, Isa::kScalar, always, nullptr, k::scalar::gemm_bf16},
    {Method::kBf16, Isa::kAvx2, always, nullptr, k::avx2::gemm_bf16},
    {Method::kBf16, Isa::kAvx512, has_avx512_bf16, nullptr, k::avx512::gemm_bf16},
    {Method::kBf16, Isa::kAmx, always, nullptr, k::amx::gemm_bf16},
    {Method::kBf16, Isa::kAmxEmu, always, nullptr, k::amx_emu::gemm_bf16},
    {Method::kInt8, Isa::kScalar, always, k::scalar::gemm_q8<Int8Decoder>, k::scalar::gemm_a16<Int8Decoder>},
    {Method::kInt8, Isa::kAvx2, always, k::avx2::gemm_q8<Int8Decoder>, k::avx2::gemm_a16<Int8Decoder>},
    {Method::kInt8, Isa::kAvx512, has_avx512_vnni, k::avx512::gemm_q8<Int8Decoder>,
     k::avx512::gemm_a16<Int8Decoder>},
    {Method::kInt8, Isa::kAmx, always, k::amx::gemm_q8<Int8Decoder>, k::amx::gemm_a16<Int8Decoder>},
    {Method::kInt8, Isa::kAmxEmu, always, k::amx_emu::gemm_q8<Int8Decoder>,
     k::amx_emu::gemm_a16<Int8Decoder>},
    {Method::kInt4, Isa::kScalar, always, k::scalar::gemm_q8<Int4Decoder>, k::scalar::gemm_a16<Int4Decoder>},
    {Method::kInt4, Isa::kAvx2, always, k::avx2::gemm_q8<Int4Decoder>, k::avx2::gemm_a16<Int4Decoder>},
    {Method::kInt4, Isa::kAvx512, has_avx512_vnni, k::avx512::gemm_q8<Int4Decoder>,
     k::avx512::gemm_a16<Int4Decoder>},
    {Method::kInt4, Isa::kAmx, always, k::amx::gemm_q8<Int4Decoder>, k::amx::gemm_a16<Int4Decoder>},
    {Method::kInt4, Isa::kAmxEmu, always, k::amx_emu::gemm_q8<Int4Decoder>,
     k::amx_emu::gemm_a16<Int4Decoder>},
    {Method::kFp8, Isa::kScalar, always, nullptr, k::scalar::gemm_fp8},
    {Method::kFp8, Isa::kAvx2, always, nullptr, k::avx2::gemm_fp8},
    {Method::kFp8, Isa::kAvx512, has_avx512_bf16_vbmi, nullptr, k::avx512::gemm_fp8},
    {Method::kFp8PerChannel, Isa::kScalar, always, nullptr, k::scalar::gemm_fp8},
    {Method::kFp8PerChannel, Isa::kAvx2, always, nullptr, k::avx2::gemm_fp8},
    {Method::kFp8PerChannel, Isa::kAvx512, has_avx512_bf16_vbmi, nullptr, k::avx512::gemm_fp8},
    {Method::kRawInt4, Isa::kScalar, always, nullptr, k::scalar::gemm_a16<RawInt4Decoder>},
    {Method::kRawInt4, Isa::kAvx2, always, nullptr, k::avx2::gemm_a16<RawInt4Decoder>},
    {Method::kRawInt4, Isa::kAvx512, has_avx512_vnni, nullptr, k::avx512::gemm_a16<RawInt4Decoder>},
    {Method::kGptqInt4, Isa::kScalar, always, nullptr, k::scalar::gemm_a16<GptqInt4Decoder>},
    {Method::kGptqInt4, Isa::kAvx2, always, nullptr, k::avx2::gemm_a16<GptqInt4Decoder>},
    {Method::kGptqInt4, Isa::kAvx512, has_avx512_vnni, nullptr, k::avx512::gemm_a16<GptqInt4Decoder>},
    {Method::kMxfp4, Isa::kScalar, always, nullptr, k::scalar::gemm_a16<Mxfp4Decoder>},
    {Method::kMxfp4, Isa::kAvx2, always, nullptr, k::avx2::gemm_a16<Mxfp4Decoder>},
    {Method::kMxfp4, Isa::kAvx512, has_avx512_vnni, nullptr, k::avx512::gemm_a16<Mxfp4Decoder>},
    {Method::kNvfp4, Isa::kScalar, always, nullptr, k::scalar::gemm_a16<Nvfp4Decoder>},
    {Method::kNvfp4, Isa::kAvx2, always, nullptr, k::avx2::gemm_a16<Nvfp4Decoder>},
    {Method::kNvfp4, Isa::kAvx512, has_avx512_vnni, nullptr, k::avx512::gemm_a16<Nvfp4Decoder>},
};

std::string upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

const MethodOps& method_ops(Method m) {
  return kOps[static_cast<int>(m)];
}

std::span<const KernelRow> kernel_rows() {
  return kKernels;
}

std::string method_names() {
  std::string out;
  for (const auto& t : kMethodTable) out += (out.empty() ? "" : ", ") + std::string(t.name);
  return out;
}

Method parse_method(std::string_view name) {
  const std::string key = upper(name);
  for (const auto& t : kMethodTable) {
    if (key == t.name) return t.method;
    for (const char* alias : t.aliases)
      if (alias && key == alias) return t.method;
  }
  throw std::invalid_argument("unknown method '" + std::string(name) + "': expected one of " +
                              method_names());
}

}  // namespace kt
