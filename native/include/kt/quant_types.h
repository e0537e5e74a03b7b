// THE table of weight methods and their packed layout. One source of truth: Python reads it through
// the bindings (kt_sglang.engine.methods).
//
// Packed layout (per weight matrix W[N, K], output channels N, reduction K): N in panels of 16
// channels; a panel holds all of K in groups of `group` K-values; within a group the weights are in
// VNNI order, i.e. 64-byte rows each holding 16 channels x (64 / 16 bytes) consecutive K-values:
//   BF16: row r holds W[n][2r], W[n][2r+1] for n = 0..15            (AMX tdpbf16ps B tile rows)
//   INT8: row r holds W[n][4r..4r+3] + 128 as u8 for n = 0..15     (AMX tdpbsud B tile rows)
//   INT4: two such rows share a 64-byte row, nibbles q in 0..15: low nibble = row r, high nibble =
//         row r + group/8 (so one AND and one shift give two int8 rows)
// followed, for the quantized methods, by the group's fp16 scales: INT8 `scale[16]`
// (w = scale * (u8 - 128)), INT4 `scale[16]`, `min[16]` (w = scale * q + min).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kt {

enum class Method : int { kBf16 = 0, kInt8 = 1, kInt4 = 2 };

inline constexpr int kPanelWidth = 16;  // output channels per panel
inline constexpr int kKAlign = 64;      // K and the intermediate slices are padded to this

struct MethodTraits {
  Method method;
  const char* name;       // as in --kt-method
  int default_group;      // K-values per scale group; BF16 has no scales (group = kKAlign)
  int allowed_groups[3];  // 0 = unused slot
  bool int8_activations;  // gate/up inputs quantized per (token, group) to int8
  // The down projection's input h quantized per (row, group) to int8 as well; else it stays bf16
  // (the A16 kernels). INT8 keeps bf16: int8 h was most of its error (0.017 -> 0.014 at groups of
  // 64). INT4 takes int8: the same ~0.01 adds little to its own 0.14 in quadrature, and its A16
  // kernel needs four vpdpwssd per 64 bytes of weights where the int8-input one needs two.
  bool int8_h;
};

// Defaults measured in docs/engine.md: INT8 groups of 64 reach rel. error 0.014 (per-channel:
// 0.026); INT4 asymmetric groups of 64 with a searched clipping range reach 0.14.
inline constexpr MethodTraits kMethodTable[] = {
    {Method::kBf16, "BF16", kKAlign, {kKAlign, 0, 0}, false, false},
    {Method::kInt8, "AMXINT8", 64, {32, 64, 128}, true, false},
    {Method::kInt4, "AMXINT4", 64, {32, 64, 128}, true, true},
};

inline const MethodTraits& method_traits(Method m) {
  return kMethodTable[static_cast<int>(m)];
}

inline Method parse_method(std::string_view name) {
  for (const auto& t : kMethodTable)
    if (name == t.name) return t.method;
  throw std::invalid_argument("unknown method '" + std::string(name) +
                              "': expected one of BF16, AMXINT8, AMXINT4");
}

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
  switch (m) {
    case Method::kBf16:
      return int64_t{kPanelWidth} * group * 2;
    case Method::kInt8:
      return int64_t{kPanelWidth} * group;
    case Method::kInt4:
      return int64_t{kPanelWidth} * group / 2;
  }
  return 0;
}
constexpr int64_t group_scale_bytes(Method m) {
  switch (m) {
    case Method::kBf16:
      return 0;
    case Method::kInt8:
      return kPanelWidth * 2;
    case Method::kInt4:
      return kPanelWidth * 4;
  }
  return 0;
}
constexpr int64_t group_bytes(Method m, int group) {
  return group_weight_bytes(m, group) + group_scale_bytes(m);
}
// One panel covers K (a multiple of `group`).
inline int64_t panel_bytes(Method m, int group, int64_t K) {
  return K / group * group_bytes(m, group);
}

}  // namespace kt
