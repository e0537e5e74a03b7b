#include "kt/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "methods/registry.h"

namespace kt {

int64_t CanonicalMatrix::weight_row_bytes() const {
  const CanonicalTensor& w = method_traits(method).tensors[0];
  const int64_t bytes = w.dtype == TensorDType::kBf16 || w.dtype == TensorDType::kFp16 ? 2 : 1;
  return w.shape == TensorShape::kNHalfK ? (K + 1) / 2 : K * bytes;
}

bool CanonicalMatrix::complete() const {
  void* const tensors[] = {weight, scales, mins};
  const auto& spec = method_traits(method).tensors;
  for (int i = 0; i < 3; ++i)
    if (spec[i].name && !tensors[i]) return false;
  return true;
}

namespace {

// The hot loops are cloned per ISA by the compiler and picked at load time, so quantizing a model on
// load runs at SIMD speed on any x86-64 CPU.
#define KT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// Round half to even for |x| < 2^22 (all quantized values here): adding and removing 1.5 * 2^23
// leaves the rounded integer. Unlike nearbyint it vectorizes on every target.
inline float round_even(float x) {
  constexpr float kMagic = 12582912.0f;  // needs IEEE arithmetic: never build with -ffast-math
  return (x + kMagic) - kMagic;
}

KT_CLONES void load_row(const void* src, DType dtype, int64_t K, float* out) {
  switch (dtype) {
    case DType::kFloat32:
      std::copy_n(static_cast<const float*>(src), K, out);
      break;
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < K; ++i) out[i] = bf16_to_float(s[i]);
      break;
    }
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < K; ++i) out[i] = fp16_to_float(s[i]);
      break;
    }
  }
}

KT_CLONES void min_max(const float* x, int64_t n, float& lo, float& hi) {
  float a = x[0], b = x[0];
  for (int64_t i = 1; i < n; ++i) a = std::min(a, x[i]), b = std::max(b, x[i]);
  lo = a, hi = b;
}

// q = clamp(round((w - m) / s), 0, 15) for one group, as bytes.
KT_CLONES void int4_codes(const float* w, int64_t n, float s, float m, uint8_t* q) {
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int64_t i = 0; i < n; ++i)
    q[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, round_even((w[i] - m) * inv))));
}

// Sixteen running maxima: a single one is a reduction GCC does not vectorize without -ffast-math
// (a scalar loop here took 10% of an INT4 prefill, quantizing the activations).
KT_CLONES float abs_max(const float* x, int64_t n) {
  float partial[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) partial[j] = std::max(partial[j], std::fabs(x[i + j]));
  float m = 0.0f;
  for (; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  for (float v : partial) m = std::max(m, v);
  return m;
}

// Squared error of w ~= s * clamp(round((w - m) / s), 0, 15) + m. Sixteen partial sums: a single
// float accumulator would serialize the loop (float addition is not reassociated).
KT_CLONES float int4_error(const float* w, int64_t n, float s, float m) {
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  float partial[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float q = std::min(15.0f, std::max(0.0f, round_even((w[i + j] - m) * inv)));
      const float d = s * q + m - w[i + j];
      partial[j] += d * d;
    }
  for (; i < n; ++i) {
    const float q = std::min(15.0f, std::max(0.0f, round_even((w[i] - m) * inv)));
    const float d = s * q + m - w[i];
    partial[0] += d * d;
  }
  float err = 0.0f;
  for (float p : partial) err += p;
  return err;
}

float round_fp16(float x) {
  return fp16_to_float(float_to_fp16(x));
}

// Index of the first value of n whose `mask` bits are all set (inf or NaN for a float's exponent
// bits), or -1. The scan is a min over ~v & mask, which vectorizes (an OR of compares stayed
// scalar: 1.8 against 48 G values/s); the weights are being read anyway, so a load pays ~nothing.
template <class T>
__attribute__((always_inline)) inline int64_t first_all_set_body(const T* v, int64_t n, T mask) {
  T least = mask;
  for (int64_t i = 0; i < n; ++i) least = std::min<T>(least, static_cast<T>(~v[i] & mask));
  if (least != 0) return -1;
  for (int64_t i = 0; i < n; ++i)
    if ((v[i] & mask) == mask) return i;
  return -1;
}
// Copies n bf16 values and returns the index of the first inf or NaN among them, or -1: one pass.
KT_CLONES int64_t copy_bf16_checked(const uint16_t* src, int64_t n, uint16_t* dst) {
  uint16_t least = 0x7f80;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = src[i];
    least = std::min<uint16_t>(least, static_cast<uint16_t>(~src[i] & 0x7f80));
  }
  if (least != 0) return -1;
  return first_all_set_body(src, n, uint16_t{0x7f80});
}

// One clone set per type: GCC makes no clones of a template.
KT_CLONES int64_t first_all_set(const uint8_t* v, int64_t n, uint8_t mask) {
  return first_all_set_body(v, n, mask);
}
KT_CLONES int64_t first_all_set(const uint16_t* v, int64_t n, uint16_t mask) {
  return first_all_set_body(v, n, mask);
}
KT_CLONES int64_t first_all_set(const uint32_t* v, int64_t n, uint32_t mask) {
  return first_all_set_body(v, n, mask);
}

int64_t first_non_finite_in(const void* src, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::kFloat32:
      return first_all_set(static_cast<const uint32_t*>(src), n, uint32_t{0x7f800000});
    case DType::kFloat16:
      return first_all_set(static_cast<const uint16_t*>(src), n, uint16_t{0x7c00});
    case DType::kBFloat16:
      return first_all_set(static_cast<const uint16_t*>(src), n, uint16_t{0x7f80});
  }
  return -1;
}

void quantize_int8_row(const float* w, int64_t K, int group, int8_t* q, uint16_t* scales) {
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
    const int64_t n = std::min<int64_t>(group, K - g0);
    const uint16_t s16 = float_to_fp16(abs_max(w + g0, n) / 127.0f);
    const float s = fp16_to_float(s16);
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    scales[gi] = s16;
    for (int64_t i = 0; i < n; ++i)
      q[g0 + i] = static_cast<int8_t>(std::clamp(round_even(w[g0 + i] * inv), -127.0f, 127.0f));
  }
}

// Asymmetric int4 with a searched clipping range: both ends of [min, max] shrink independently
// (5 x 5 candidates), and the pair with the least squared error wins (rel. error 0.082 vs 0.090
// for plain min/max on Gaussian groups of 64).
void quantize_int4_row(const float* w, int64_t K, int group, uint8_t* packed, uint16_t* scales,
                       uint16_t* mins) {
  static constexpr float kShrink[] = {1.0f, 0.95f, 0.9f, 0.85f, 0.8f};
  std::fill_n(packed, (K + 1) / 2, uint8_t{0});
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
    const int64_t n = std::min<int64_t>(group, K - g0);
    const float* x = w + g0;
    float lo = 0.0f, hi = 0.0f;
    if (n > 0) min_max(x, n, lo, hi);
    float best_s = round_fp16((hi - lo) / 15.0f), best_m = round_fp16(lo);
    float best_err = int4_error(x, n, best_s, best_m);
    for (float cl : kShrink) {
      for (float ch : kShrink) {
        if (cl == 1.0f && ch == 1.0f) continue;
        const float s = round_fp16((hi * ch - lo * cl) / 15.0f), m = round_fp16(lo * cl);
        const float err = int4_error(x, n, s, m);
        if (err < best_err) best_err = err, best_s = s, best_m = m;
      }
    }
    scales[gi] = float_to_fp16(best_s);
    mins[gi] = float_to_fp16(best_m);
    uint8_t codes[128];
    int4_codes(x, n, best_s, best_m, codes);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = g0 + i;
      packed[k / 2] |= (k % 2 == 0) ? codes[i] : static_cast<uint8_t>(codes[i] << 4);
    }
  }
}

}  // namespace

void throw_non_finite(const char* what, int64_t row, int64_t col, float value) {
  throw std::invalid_argument(std::string(what) + " at row " + std::to_string(row) + ", column " +
                              std::to_string(col) + " is " + (std::isnan(value) ? "NaN" : "infinite"));
}

int64_t first_non_finite(const void* src, DType dtype, int64_t n) {
  return first_non_finite_in(src, dtype, n);
}

void load_checked_row(const void* src, DType dtype, int64_t K, int64_t row, int64_t col0, float* out) {
  load_row(src, dtype, K, out);
  const int64_t c = first_all_set(reinterpret_cast<const uint32_t*>(out), K, uint32_t{0x7f800000});
  if (c >= 0) throw_non_finite("weight", row, col0 + c, out[c]);
}

void quantize_rows(const void* src, DType dtype, CanonicalMatrix& dst, int64_t row_begin, int64_t row_end) {
  const MethodTraits& traits = method_traits(dst.method);
  if (!traits.quantizes_dense)
    throw std::invalid_argument(std::string("quantize: ") + traits.name +
                                " cannot be made from dense weights");
  if (!src || !dst.complete()) throw std::invalid_argument("quantize: null source or destination tensor");
  if (dst.N < 0 || dst.K < 1 || row_begin < 0 || row_end > dst.N || row_begin > row_end)
    throw std::invalid_argument("quantize: bad matrix shape or row range");
  if (!group_allowed(dst.method, dst.group))
    throw std::invalid_argument("quantize: group size " + std::to_string(dst.group) + " is not allowed for " +
                                traits.name);
  method_ops(dst.method).quantize_rows(src, dtype, dst, row_begin, row_end);
}

void check_finite(const CanonicalMatrix& m) {
  void* const tensors[] = {m.weight, m.scales, m.mins};
  const auto& spec = method_traits(m.method).tensors;
  const int64_t groups = m.num_groups(), blocks = (m.N + m.group - 1) / m.group;
  for (int i = 0; i < 3; ++i) {
    if (!spec[i].name) continue;
    int64_t rows = m.N, cols = 1;
    switch (spec[i].shape) {
      case TensorShape::kNK:
        cols = m.K;
        break;
      case TensorShape::kNHalfK:
        cols = (m.K + 1) / 2;
        break;
      case TensorShape::kNGroups:
        cols = groups;
        break;
      case TensorShape::kBlocks:
        rows = blocks, cols = groups;
        break;
      case TensorShape::kN:
        break;
      case TensorShape::kOne:
        rows = 1;
        break;
    }
    // A NaN code of a one-byte float: e4m3fn's S.1111.111 (it has no inf), e8m0's 255.
    auto refuse_code = [&](uint8_t nan_bits, const char* what) {
      const int64_t at = first_all_set(static_cast<const uint8_t*>(tensors[i]), rows * cols, nan_bits);
      if (at >= 0)
        throw std::invalid_argument(std::string(spec[i].name) + " at row " + std::to_string(at / cols) +
                                    ", column " + std::to_string(at % cols) + " is NaN" + what);
    };
    DType dtype;
    switch (spec[i].dtype) {
      case TensorDType::kBf16:
        dtype = DType::kBFloat16;
        break;
      case TensorDType::kFp16:
        dtype = DType::kFloat16;
        break;
      case TensorDType::kFp32:
        dtype = DType::kFloat32;
        break;
      case TensorDType::kFp8E4m3:
        refuse_code(0x7f, "");
        continue;
      case TensorDType::kE8m0:
        refuse_code(0xff, " (e8m0 255)");
        continue;
      default:
        continue;  // integers have no inf or NaN
    }
    const int64_t at = first_non_finite_in(tensors[i], dtype, rows * cols);
    if (at >= 0) throw_non_finite(spec[i].name, at / cols, at % cols, load_as_float(tensors[i], dtype, at));
  }
}

void quantize_rows_rowwise(const void* src, DType dtype, CanonicalMatrix& dst, int64_t row_begin,
                           int64_t row_end) {
  const int64_t K = dst.K;
  const int64_t G = dst.num_groups();
  const int64_t elem = dtype == DType::kFloat32 ? 4 : 2;
  auto* scales = static_cast<uint16_t*>(dst.scales);
  auto* mins = static_cast<uint16_t*>(dst.mins);
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t r = row_begin; r < row_end; ++r) {
    const void* s = static_cast<const char*>(src) + r * K * elem;
    auto* out = static_cast<uint8_t*>(dst.weight) + r * dst.weight_row_bytes();
    if (dst.method == Method::kBf16) {
      auto* o = reinterpret_cast<uint16_t*>(out);
      if (dtype == DType::kBFloat16) {
        const int64_t c = copy_bf16_checked(static_cast<const uint16_t*>(s), K, o);
        if (c >= 0) throw_non_finite("weight", r, c, bf16_to_float(static_cast<const uint16_t*>(s)[c]));
      } else {
        load_checked_row(s, dtype, K, r, 0, row.data());
        for (int64_t i = 0; i < K; ++i) o[i] = float_to_bf16(row[i]);
      }
      continue;
    }
    load_checked_row(s, dtype, K, r, 0, row.data());
    if (dst.method == Method::kInt8)
      quantize_int8_row(row.data(), K, dst.group, reinterpret_cast<int8_t*>(out), scales + r * G);
    else
      quantize_int4_row(row.data(), K, dst.group, out, scales + r * G, mins + r * G);
  }
}

namespace {
KT_CLONES void quantize_activation_row_impl(const float* x, int64_t K, int group, bool per_row, int8_t* q,
                                            float* scale, float* scaled_sum) {
  const float row_max = per_row ? abs_max(x, K) : 0.0f;
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
    const float m = per_row ? row_max : abs_max(x + g0, group);
    const float s = m / 127.0f;
    const float inv = m > 0.0f ? 127.0f / m : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < group; ++i) {
      const int32_t v = static_cast<int32_t>(round_even(x[g0 + i] * inv));
      q[g0 + i] = static_cast<int8_t>(v);
      sum += v;
    }
    scale[gi] = s;
    scaled_sum[gi] = s * static_cast<float>(sum);
  }
}

}  // namespace

void quantize_activation_row(const float* x, int64_t K, int group, bool per_row, int8_t* q, float* scale,
                             float* scaled_sum) {
  quantize_activation_row_impl(x, K, group, per_row, q, scale, scaled_sum);
}

}  // namespace kt
