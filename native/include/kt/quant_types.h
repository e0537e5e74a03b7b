// THE table of weight methods: one row per method says everything the engine and the Python side
// need to know about it (name, canonical tensors, packed layout, what its kernels read, its test
// bound). Python reads it through the bindings (kt_sglang.engine.methods); the kernels of each
// method are registered per ISA in src/methods/registry.cpp. docs/engine.md ("Adding a method")
// lists the files a new method touches.
//
// Packed layout (per weight matrix W[N, K], output channels N, reduction K): N in panels of 16
// channels; a panel holds all of K in groups of `group` K-values; within a group the weights are in
// VNNI order, i.e. rows each holding 16 channels x a few consecutive K-values:
//   BF16: 64-byte row r holds W[n][2r], W[n][2r+1] for n = 0..15     (AMX tdpbf16ps B tile rows)
//   INT8: 64-byte row r holds W[n][4r..4r+3] + 128 as u8 for n = 0..15 (AMX tdpbsud B tile rows)
//   INT4: two INT8-style rows share a 64-byte row, nibbles q in 0..15: low nibble = row r, high
//         nibble = row r + group/8 (so one AND and one shift give two int8 rows)
//   FP8:  32-byte row r holds the e4m3 bytes of W[n][2r], W[n][2r+1] for n = 0..15 (BF16's order at
//         one byte a weight: decoding a row gives one BF16 row)
//   RAWINT4, GPTQ_INT4, MXFP4, NVFP4: INT4's nibble layout (the FP4 methods' nibbles are e2m1 codes)
// followed by the group's scale block, per channel: INT8 fp16 `scale[16]` (w = scale * (u8 - 128)),
// INT4 fp16 `scale[16]`, `min[16]` (w = scale * q + min), FP8 fp32 `scale[16]` (w = scale * e4m3),
// RAWINT4 bf16 `scale[16]` (w = scale * (q - 8)), GPTQ_INT4 fp16 `scale[16]`, fp16 `-zero[16]`
// (w = scale * (q - zero)), MXFP4 e8m0 `scale[16]` (w = 2^(scale - 127) * e2m1), NVFP4 e4m3
// `scale[16]` then the matrix's fp32 `global` (w = scale * global * e2m1).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kt {

enum class Method : int {
  kBf16 = 0,
  kInt8 = 1,
  kInt4 = 2,
  kFp8 = 3,
  kFp8PerChannel = 4,
  kRawInt4 = 5,
  kGptqInt4 = 6,
  kMxfp4 = 7,
  kNvfp4 = 8,
};
inline constexpr int kNumMethods = 9;

inline constexpr int kPanelWidth = 16;  // output channels per panel
inline constexpr int kKAlign = 64;      // K and the intermediate slices are padded to this

// What a method's kernels read as activations: bf16 rows, or int8 rows quantized per (row, group).
enum class Activation : int { kBf16 = 0, kInt8 = 1 };

// One tensor of a canonical matrix W[N, K] (kt/quantize.h): its dtype and how its shape follows
// from N, K and the group g.
enum class TensorDType : int {
  kBf16 = 0,
  kFp16 = 1,
  kFp32 = 2,
  kInt8 = 3,
  kUint8 = 4,
  kFp8E4m3 = 5,
  kE8m0 = 6,  // 2^(e - 127), the MX formats' scales
};
enum class TensorShape : int {
  kNK = 0,       // [N, K]
  kNHalfK = 1,   // [N, ceil(K / 2)]: two nibbles a byte
  kNGroups = 2,  // [N, ceil(K / g)]: one value per row and group
  kBlocks = 3,   // [ceil(N / g), ceil(K / g)]: one value per g x g block
  kN = 4,        // [N]: one value per row
  kOne = 5,      // [1]: one value for the matrix
};
struct CanonicalTensor {
  const char* name = nullptr;  // "weight", "scales", "mins", "zeros" or "global_scale"; nullptr: unused
  TensorDType dtype = TensorDType::kBf16;
  TensorShape shape = TensorShape::kNK;
};

struct MethodTraits {
  Method method;
  const char* name;  // as in --kt-method
  // Accepted as well (any case): convert-cpu's int4/int8, and kt-kernel's MOE_INT4/MOE_INT8 (its
  // general, non-AMX kernels for the same weights; here every method runs on every ISA); nullptr: unused
  const char* aliases[2];
  const char* summary;    // one line for --help and docs
  int default_group;      // K-values per scale group; BF16 has no scales (group = kKAlign)
  int allowed_groups[4];  // 0 = unused slot
  // What gate/up and the down projection read. INT8 keeps a bf16 h: an int8 h raises its error from
  // 0.014 to 0.017 at groups of 64. INT4 takes int8: the same ~0.01 adds little to its own 0.14 in
  // quadrature, and its bf16-input kernel needs four vpdpwssd per 64 bytes of weights where the
  // int8-input one needs two.
  // RAWINT4, GPTQ_INT4 and MXFP4 read bf16: their only error is the activations' rounding, and int8
  // activations alone give 0.012-0.018 on random layers (bf16 h: 0.008-0.010; bf16: 0.0023).
  Activation gate_up_input;
  Activation down_input;
  // Gate/up's int8 input with one scale per token rather than per group (INT4): the AMX kernel then
  // sums a row's products over all of K in int32 and scales once, where per-group scales cost a
  // vector epilogue per group. Adds ~0.001 to INT4's 0.14 error (INT8's 0.014 would become ~0.02).
  // h keeps its groups: a pool quantizes only its slice of h, and one scale per slice would make
  // the result depend on how the pools split the layer.
  bool gate_up_input_per_row;
  int weight_bits;        // packed bits per weight
  int scale_bytes;        // packed scale bytes per channel and group
  int scale_extra_bytes;  // packed bytes per group after the channels' scales (NVFP4's global)
  bool quantizes_dense;   // the engine quantizes bf16/fp16/fp32 matrices to it (kt/quantize.h)
  // The stored weight value that stands for zero where no mins or zeros tensor says it (RAWINT4's
  // nibbles hold q + 8); 0 for the others.
  int weight_zero;
  // What packed weight values stand for when they are not integers: "e2m1" (float4 codes).
  const char* weight_codes;
  // The checkpoint format whose values it takes as they are (kt_sglang/weights/checkpoint.py reads
  // it): "fp8", "pack-quantized" (compressed-tensors), "gptq"; nullptr: the engine quantizes.
  const char* checkpoint_format;
  CanonicalTensor tensors[3];
  float error_bound;  // relative L2 error of a random layer against float32 (tests, check-engine)
};

// Bounds measured in docs/engine.md: INT8 groups of 64 reach rel. error 0.014 (per-channel:
// 0.026); INT4 asymmetric groups of 64 with a searched clipping range reach 0.14; FP8 (the
// checkpoint's own e4m3 values and 128 x 128 or per-channel scales, decoded exactly) 0.047 against
// the weights before FP8, and within bf16 rounding of the activations (0.0023) against its
// dequantized ones.
inline constexpr MethodTraits kMethodTable[kNumMethods] = {
    {.method = Method::kBf16,
     .name = "BF16",
     .aliases = {nullptr, nullptr},
     .summary = "bf16 weights (2 bytes per weight)",
     .default_group = kKAlign,
     .allowed_groups = {kKAlign, 0, 0},
     .gate_up_input = Activation::kBf16,
     .down_input = Activation::kBf16,
     .gate_up_input_per_row = false,
     .weight_bits = 16,
     .scale_bytes = 0,
     .scale_extra_bytes = 0,
     .quantizes_dense = true,
     .weight_zero = 0,
     .weight_codes = nullptr,
     .checkpoint_format = nullptr,
     .tensors = {{"weight", TensorDType::kBf16, TensorShape::kNK}},
     .error_bound = 0.01f},
    {.method = Method::kInt8,
     .name = "AMXINT8",
     .aliases = {"INT8", "MOE_INT8"},
     .summary = "int8 weights, fp16 scale per group of K",
     .default_group = 64,
     .allowed_groups = {16, 32, 64, 128},
     .gate_up_input = Activation::kInt8,
     .down_input = Activation::kBf16,
     .gate_up_input_per_row = false,
     .weight_bits = 8,
     .scale_bytes = 2,
     .scale_extra_bytes = 0,
     .quantizes_dense = true,
     .weight_zero = 0,
     .weight_codes = nullptr,
     .checkpoint_format = nullptr,
     .tensors = {{"weight", TensorDType::kInt8, TensorShape::kNK},
                 {"scales", TensorDType::kFp16, TensorShape::kNGroups}},
     .error_bound = 0.02f},
    {.method = Method::kInt4,
     .name = "AMXINT4",
     .aliases = {"INT4", "MOE_INT4"},
     .summary = "int4 weights, fp16 scale and min per group of K",
     .default_group = 64,
     .allowed_groups = {16, 32, 64, 128},
     .gate_up_input = Activation::kInt8,
     .down_input = Activation::kInt8,
     .gate_up_input_per_row = true,
     .weight_bits = 4,
     .scale_bytes = 4,
     .scale_extra_bytes = 0,
     .quantizes_dense = true,
     .weight_zero = 0,
     .weight_codes = nullptr,
     .checkpoint_format = nullptr,
     .tensors = {{"weight", TensorDType::kUint8, TensorShape::kNHalfK},
                 {"scales", TensorDType::kFp16, TensorShape::kNGroups},
                 {"mins", TensorDType::kFp16, TensorShape::kNGroups}},
     .error_bound = 0.16f},
    {.method = Method::kFp8,
     .name = "FP8",
     .aliases = {"FP8_BLOCK", nullptr},
     .summary = "float8 e4m3 weights as checkpoints ship them, fp32 scale per 128 x 128 block",
     .default_group = 128,
     .allowed_groups = {128, 0, 0},
     .gate_up_input = Activation::kBf16,
     .down_input = Activation::kBf16,
     .gate_up_input_per_row = false,
     .weight_bits = 8,
     .scale_bytes = 4,
     .scale_extra_bytes = 0,
     .quantizes_dense = true,
     .weight_zero = 0,
     .weight_codes = nullptr,
     .checkpoint_format = "fp8",
     .tensors = {{"weight", TensorDType::kFp8E4m3, TensorShape::kNK},
                 {"scales", TensorDType::kFp32, TensorShape::kBlocks}},
     .error_bound = 0.06f},
    {.method = Method::kFp8PerChannel,
     .name = "FP8_PERCHANNEL",
     .aliases = {nullptr, nullptr},
     .summary = "float8 e4m3 weights as checkpoints ship them, fp32 scale per output channel",
     .default_group = 128,
     .allowed_groups = {128, 0, 0},
     .gate_up_input = Activation::kBf16,
     .down_input = Activation::kBf16,
     .gate_up_input_per_row = false,
     .weight_bits = 8,
     .scale_bytes = 4,
     .scale_extra_bytes = 0,
     .quantizes_dense = true,
     .weight_zero = 0,
     .weight_codes = nullptr,
     .checkpoint_format = "fp8",
     .tensors = {{"weight", TensorDType::kFp8E4m3, TensorShape::kNK},
                 {"scales", TensorDType::kFp32, TensorShape::kN}},
     .error_bound = 0.06f},
    {.method = Method::kRawInt4,
     .name = "RAWINT4",
     .aliases = {nullptr, nullptr},
     .summary = "int4 weights as compressed-tensors pack-quantized checkpoints ship them (Kimi-K2): "
                "symmetric, bf16 scale per group of K",
     .default_group = 32,
     .allowed_groups = {32, 64, 128},
     .gate_up_input = Activation::kBf16,
     .down_input = Activation::kBf16,
     .gate_up_input_per_row = false,
     .weight_bits = 4,
     .scale_bytes = 2,
     .scale_extra_bytes = 0,
     .quantizes_dense = false,
     .weight_zero = 8,
     .weight_codes = nullptr,
     .checkpoint_format = "pack-quantized",
     .tensors = {{"weight", TensorDType::kUint8, TensorShape::kNHalfK},
                 {"scales", TensorDType::kBf16, TensorShape::kNGroups}},
     .error_bound = 0.01f},
    {.method = Method::kGptqInt4,
     .name = "GPTQ_INT4",
     .aliases = {"GPTQ", nullptr},
     .summary = "int4 weights as GPTQ checkpoints ship them: fp16 scale and zero point per group of K",
     .default_group = 128,
     .allowed_groups = {32, 64, 128},
     .gate_up_input = Activation::kBf16,
     .down_input = Activation::kBf16,
     .gate_up_input_per_row = false,
     .weight_bits = 4,
     .scale_bytes = 4,
     .scale_extra_bytes = 0,
     .quantizes_dense = false,
     .weight_zero = 0,
     .weight_codes = nullptr,
     .checkpoint_format = "gptq",
     .tensors = {{"weight", TensorDType::kUint8, TensorShape::kNHalfK},
                 {"scales", TensorDType::kFp16, TensorShape::kNGroups},
                 {"zeros", TensorDType::kUint8, TensorShape::kNGroups}},
     .error_bound = 0.01f},
    {.method = Method::kMxfp4,
     .name = "MXFP4",
     .aliases = {nullptr, nullptr},
     .summary = "float4 e2m1 weights with an e8m0 scale per 32 of K, as checkpoints ship them "
                "(gpt-oss, DeepSeek-V4-Flash)",
     .default_group = 32,
     .allowed_groups = {32, 0, 0},
     .gate_up_input = Activation::kBf16,
     .down_input = Activation::kBf16,
     .gate_up_input_per_row = false,
     .weight_bits = 4,
     .scale_bytes = 1,
     .scale_extra_bytes = 0,
     .quantizes_dense = false,
     .weight_zero = 0,
     .weight_codes = "e2m1",
     .checkpoint_format = "mxfp4",
     .tensors = {{"weight", TensorDType::kUint8, TensorShape::kNHalfK},
                 {"scales", TensorDType::kE8m0, TensorShape::kNGroups}},
     .error_bound = 0.01f},
    {.method = Method::kNvfp4,
     .name = "NVFP4",
     .aliases = {nullptr, nullptr},
     .summary = "float4 e2m1 weights with an e4m3 scale per 16 of K and an fp32 scale per matrix, as "
                "ModelOpt and compressed-tensors checkpoints ship them",
     .default_group = 16,
     .allowed_groups = {16, 0, 0},
     .gate_up_input = Activation::kBf16,
     .down_input = Activation::kBf16,
     .gate_up_input_per_row = false,
     .weight_bits = 4,
     .scale_bytes = 1,
     .scale_extra_bytes = 4,
     .quantizes_dense = false,
     .weight_zero = 0,
     .weight_codes = "e2m1",
     .checkpoint_format = "nvfp4",
     .tensors = {{"weight", TensorDType::kUint8, TensorShape::kNHalfK},
                 {"scales", TensorDType::kFp8E4m3, TensorShape::kNGroups},
                 {"global_scale", TensorDType::kFp32, TensorShape::kOne}},
     .error_bound = 0.01f},
};

constexpr bool rows_follow_enum() {
  for (int i = 0; i < kNumMethods; ++i)
    if (static_cast<int>(kMethodTable[i].method) != i) return false;
  return true;
}
static_assert(rows_follow_enum(), "kMethodTable's rows must follow Method's order");

constexpr const MethodTraits& method_traits(Method m) {
  return kMethodTable[static_cast<int>(m)];
}

// --kt-method name or alias (any case) -> Method; throws naming the methods.
Method parse_method(std::string_view name);
// "BF16, AMXINT8, ..." for messages.
std::string method_names();

inline bool group_allowed(Method m, int group) {
  for (int g : method_traits(m).allowed_groups)
    if (g != 0 && g == group) return true;
  return false;
}

inline int64_t round_up(int64_t x, int64_t a) {
  return (x + a - 1) / a * a;
}

// Bytes of one group of one panel: weights, then scales.
constexpr int64_t group_weight_bytes(Method m, int group) {
  return int64_t{kPanelWidth} * group * method_traits(m).weight_bits / 8;
}
constexpr int64_t group_scale_bytes(Method m) {
  return int64_t{kPanelWidth} * method_traits(m).scale_bytes + method_traits(m).scale_extra_bytes;
}
constexpr int64_t group_bytes(Method m, int group) {
  return group_weight_bytes(m, group) + group_scale_bytes(m);
}
// One panel covers K (a multiple of `group`).
inline int64_t panel_bytes(Method m, int group, int64_t K) {
  return K / group * group_bytes(m, group);
}

}  // namespace kt
