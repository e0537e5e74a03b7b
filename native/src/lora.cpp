// The fine-tuning tasks (kt/lora.h). Rows are the routed (token, expert) pairs grouped by expert;
// the frozen products run the method's A16 GEMM (bf16 activations, every method and ISA has one),
// the adapters' small products run portable fp32 loops cloned per ISA by the compiler.
//
// Forward, per chunk of work items, with s = alpha / r:
//   1. route; per expert: gather x, xa = x [A_gate; A_up]^T
//   2. per pool and block of intermediate channels: g, u = W x + s xa B^T; h = silu(g) u
//   3. per expert: ha = h A_down^T
//   4. per pool and run of output panels: y = W_down h (+ s ha B_down^T on one pool)
//   5. per token: out = sum over its rows of weight * y
// Backward from dY (dy = weight * dY per row):
//   1. per expert: gather dY, dyb = dY B_down
//   2. per pool and 64 intermediate channels: dhu = dY W_down + s dyb A_down (the gradient to h
//      without the routing weight)
//   3. per expert: d weight = <dhu, h>; dh = weight dhu; dg, du through silu(g) u; the adapters'
//      gradients; dgb, dub = dg B_gate, du B_up
//   4. per pool and 64 hidden channels: dx = dg W_gate + du W_up (+ s (dgb A_gate + dub A_up) on one pool)
//   5. per token: grad_in = sum over its rows of dx; grad_weights per slot
#include "kt/lora.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/packed_value.h"
#include "kt/aligned_vector.h"
#include "kt/thread_scratch.h"

namespace kt {

namespace {

constexpr int kMaxCallRows = 256;  // rows per GEMM call: bounds per-thread scratch
constexpr int kMaxPhasePools = 64;
constexpr int64_t kColBlock = 64;        // columns of one transposed-product call (4 panels of W^T)
constexpr int64_t kDownRunPanels = 32;   // output panels of one down work item
constexpr int64_t kGateUpRunBlocks = 4;  // gate/up blocks of one work item

template <class Vector>
void grow(Vector& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

#define KT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// C[i][j] += alpha * sum_k A[i][k] B[j][k]  (A [m, K], B [n, K]): dot products, 16 partial sums.
KT_CLONES void gemm_nt(int64_t m, int64_t n, int64_t K, float alpha, const float* A, int64_t lda,
                       const float* B, int64_t ldb, float* C, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float* a = A + i * lda;
      const float* b = B + j * ldb;
      float acc[16] = {};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; ++l) acc[l] += a[k + l] * b[k + l];
      float sum = 0.0f;
      for (; k < K; ++k) sum += a[k] * b[k];
      for (int l = 0; l < 16; ++l) sum += acc[l];
      C[i * ldc + j] += alpha * sum;
    }
}

// C[i][:] += alpha * sum_k A[i][k] B[k][:]  (A [m, K], B [K, n]).
KT_CLONES void gemm_nn(int64_t m, int64_t n, int64_t K, float alpha, const float* A, int64_t lda,
                       const float* B, int64_t ldb, float* C, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    float* c = C + i * ldc;
    for (int64_t k = 0; k < K; ++k) {
      const float a = alpha * A[i * lda + k];
      const float* b = B + k * ldb;
      for (int64_t j = 0; j < n; ++j) c[j] += a * b[j];
    }
  }
}

// C[i][:] += alpha * sum_k A[k][i] B[k][:]  (A [K, m], B [K, n]): the adapters' gradients.
KT_CLONES void gemm_tn(int64_t m, int64_t n, int64_t K, float alpha, const float* A, int64_t lda,
                       const float* B, int64_t ldb, float* C, int64_t ldc) {
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    for (int64_t i = 0; i < m; ++i) {
      const float a = alpha * A[k * lda + i];
      if (a == 0.0f) continue;
      float* c = C + i * ldc;
      for (int64_t j = 0; j < n; ++j) c[j] += a * b[j];
    }
  }
}

KT_CLONES void bf16_row_to_float(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

// The silu(g) * u gate's backward: dg = dh u silu'(g), du = dh silu(g).
KT_CLONES void silu_mul_backward(const float* g, const float* u, const float* dh, int64_t n, float* dg,
                                 float* du) {
  for (int64_t i = 0; i < n; ++i) {
    const float sig = 1.0f / (1.0f + std::exp(-g[i]));
    const float silu = g[i] * sig;
    dg[i] = dh[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
    du[i] = dh[i] * silu;
  }
}

// Adapter values [rows, cols] (row stride ld) of one dtype -> fp32 at dst (row stride ld_dst), or
// transposed: dst[c * ld_dst + r].
void load_f32(const void* src, DType dtype, int64_t offset, int64_t rows, int64_t cols, int64_t ld,
              bool transpose, float* dst, int64_t ld_dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t at = offset + r * ld + c;
      const float v = dtype == DType::kFloat32 ? static_cast<const float*>(src)[at]
                                               : bf16_to_float(static_cast<const uint16_t*>(src)[at]);
      dst[transpose ? c * ld_dst + r : r * ld_dst + c] = v;
    }
}

// dst[offset + i] += src[i] for n values in the gradients' dtype; with `cols` > 0 src holds the
// [n / cols, cols] block transposed ([cols, n / cols]).
void add_into(void* dst, DType dtype, int64_t offset, const float* src, int64_t n, int64_t cols) {
  const int64_t rows = cols > 0 ? n / cols : 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = cols > 0 ? src[(i % cols) * rows + i / cols] : src[i];
    if (dtype == DType::kFloat32) {
      static_cast<float*>(dst)[offset + i] += v;
    } else {
      uint16_t& d = static_cast<uint16_t*>(dst)[offset + i];
      d = float_to_bf16(bf16_to_float(d) + v);
    }
  }
}

// A 16 x 16 tile of bf16 weights from the packed layout to the transposed one, 512 bytes each way:
// src row kp (0..7) holds W[n][2kp], W[n][2kp + 1] for n = 0..15; dst row np holds W[2np][k],
// W[2np + 1][k] for k = 0..15, i.e. dst[np][k][nb] = src[k / 2][2np + nb][k % 2].
void transpose_tile_scalar(const uint16_t* src, uint16_t* dst) {
  for (int np = 0; np < 8; ++np)
    for (int k = 0; k < 16; ++k)
      for (int nb = 0; nb < 2; ++nb)
        dst[np * 32 + k * 2 + nb] = src[(k / 2) * 32 + (2 * np + nb) * 2 + k % 2];
}

// The same with AVX-512: in each 8-byte unit (2 channels x 2 K-values) swap the middle values,
// then transpose the 8 x 8 units (three rounds of two-source permutes).
__attribute__((target("avx512f,avx512bw"))) void transpose_tile_avx512(const uint16_t* src, uint16_t* dst) {
  const __m512i swap =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
  __m512i r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm512_shuffle_epi8(_mm512_loadu_si512(src + i * 32), swap);
  const __m512i even = _mm512_setr_epi64(0, 8, 2, 10, 4, 12, 6, 14),
                odd = _mm512_setr_epi64(1, 9, 3, 11, 5, 13, 7, 15);
  __m512i lo[4], hi[4];  // lo[i]: units 0, 2, 4, 6 of rows 2i, 2i + 1; hi[i]: units 1, 3, 5, 7
  for (int i = 0; i < 4; ++i) {
    lo[i] = _mm512_permutex2var_epi64(r[2 * i], even, r[2 * i + 1]);
    hi[i] = _mm512_permutex2var_epi64(r[2 * i], odd, r[2 * i + 1]);
  }
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13),
                second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  __m512i q[4][2];  // q[j][i]: units j and j + 4 of rows 4i..4i + 3 (j = 0: lo's first, 1: hi's first, ...)
  for (int i = 0; i < 2; ++i) {
    q[0][i] = _mm512_permutex2var_epi64(lo[2 * i], first, lo[2 * i + 1]);   // units 0, 4
    q[2][i] = _mm512_permutex2var_epi64(lo[2 * i], second, lo[2 * i + 1]);  // units 2, 6
    q[1][i] = _mm512_permutex2var_epi64(hi[2 * i], first, hi[2 * i + 1]);   // units 1, 5
    q[3][i] = _mm512_permutex2var_epi64(hi[2 * i], second, hi[2 * i + 1]);  // units 3, 7
  }
  const __m512i low_half = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11),
                high_half = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  for (int j = 0; j < 4; ++j) {
    _mm512_storeu_si512(dst + j * 32, _mm512_permutex2var_epi64(q[j][0], low_half, q[j][1]));
    _mm512_storeu_si512(dst + (j + 4) * 32, _mm512_permutex2var_epi64(q[j][0], high_half, q[j][1]));
  }
}

// The same with AVX2: the middle values swapped as above, then the 8 x 8 units transposed as four
// 4 x 4 blocks (unpack pairs of rows, then swap 128-bit halves).
__attribute__((target("avx2"))) void transpose_tile_avx2(const uint16_t* src, uint16_t* dst) {
  const __m256i swap = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2,
                                        3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  for (int a = 0; a < 2; ++a)      // rows 4a..4a + 3 of src: units 4a..4a + 3 of each dst row
    for (int b = 0; b < 2; ++b) {  // units 4b..4b + 3 of src rows: dst rows 4b..4b + 3
      __m256i r[4];
      for (int i = 0; i < 4; ++i)
        r[i] = _mm256_shuffle_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (4 * a + i) * 32 + 16 * b)), swap);
      const __m256i t0 = _mm256_unpacklo_epi64(r[0], r[1]), t1 = _mm256_unpackhi_epi64(r[0], r[1]),
                    t2 = _mm256_unpacklo_epi64(r[2], r[3]), t3 = _mm256_unpackhi_epi64(r[2], r[3]);
      const __m256i out[4] = {
          _mm256_permute2x128_si256(t0, t2, 0x20), _mm256_permute2x128_si256(t1, t3, 0x20),
          _mm256_permute2x128_si256(t0, t2, 0x31), _mm256_permute2x128_si256(t1, t3, 0x31)};
      for (int j = 0; j < 4; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (4 * b + j) * 32 + 16 * a), out[j]);
    }
}

using TransposeTileFn = void (*)(const uint16_t*, uint16_t*);

// 16 channels x 16 K-values (kin, a multiple of 16, within group g) of a quantized method as bf16
// rows in BF16's packed layout (`stage`: 8 rows of 16 channels x 2 K-values).
template <Method M>
void decode_tile_scalar(const uint8_t* g, int group, int kin, uint16_t* stage) {
  for (int kk = 0; kk < kPanelWidth; ++kk)
    for (int nn = 0; nn < kPanelWidth; ++nn)
      stage[(kk / 2) * 32 + nn * 2 + kk % 2] =
          float_to_bf16(kernels::packed_value<M>(g, group, nn, kin + kk));
}

// The same for the integer methods with AVX-512: per packed row of 4 K-values, 4 vectors of 16
// channels' codes, each value = weight_value(code) * scale + offset, rounded to bf16 (to nearest even).
template <Method M>
__attribute__((target("avx512f,avx512bw"))) void decode_tile_avx512(const uint8_t* g, int group, int kin,
                                                                    uint16_t* stage) {
  using namespace kernels;
  using D = typename DecoderFor<M>::type;
  const uint8_t* block = g + group_weight_bytes(M, group);
  alignas(64) float scale[kPanelWidth], offset[kPanelWidth], table[16];
  for (int n = 0; n < kPanelWidth; ++n) {
    const auto [s, o] = D::template scales<scalar::Lanes>(block, n);
    scale[n] = s;
    offset[n] = kNibbles<D> ? o : 0.0f;
  }
  for (int c = 0; c < 16; ++c) table[c] = static_cast<float>(weight_value<D>(static_cast<uint8_t>(c)));
  const __m512 vs = _mm512_load_ps(scale), vo = _mm512_load_ps(offset), vt = _mm512_load_ps(table);
  const __m512i mask = _mm512_set1_epi32(kNibbles<D> ? 0x0f : 0xff);
  for (int q = 0; q < 4; ++q) {
    const int k = kin + 4 * q;  // packed row of K-values k..k + 3
    int row = k / 4, shift = 0;
    if constexpr (kNibbles<D>)
      if (k >= group / 2) row -= group / 8, shift = 4;
    const __m512i v = _mm512_loadu_si512(g + row * 64);
    __m512i bits[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i code = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + shift), mask);
      const __m512 value = kNibbles<D> ? _mm512_permutexvar_ps(code, vt)
                                       : _mm512_cvtepi32_ps(_mm512_sub_epi32(code, _mm512_set1_epi32(128)));
      const __m512i b = _mm512_castps_si512(_mm512_fmadd_ps(value, vs, vo));
      const __m512i round = _mm512_add_epi32(
          _mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)));
      bits[j] = _mm512_srli_epi32(_mm512_add_epi32(b, round), 16);
    }
    for (int j = 0; j < 4; j += 2)  // pair rows: K-values k + j, k + j + 1 per channel
      _mm512_store_si512(stage + (2 * q + j / 2) * 32,
                         _mm512_or_si512(bits[j], _mm512_slli_epi32(bits[j + 1], 16)));
  }
}

// The same with AVX2, 8 channels a vector: the nibbles' 16-entry table is two 8-entry lookups.
template <Method M>
__attribute__((target("avx2,fma"))) void decode_tile_avx2(const uint8_t* g, int group, int kin,
                                                          uint16_t* stage) {
  using namespace kernels;
  using D = typename DecoderFor<M>::type;
  const uint8_t* block = g + group_weight_bytes(M, group);
  alignas(32) float scale[kPanelWidth], offset[kPanelWidth], table[16];
  for (int n = 0; n < kPanelWidth; ++n) {
    const auto [s, o] = D::template scales<scalar::Lanes>(block, n);
    scale[n] = s;
    offset[n] = kNibbles<D> ? o : 0.0f;
  }
  for (int c = 0; c < 16; ++c) table[c] = static_cast<float>(weight_value<D>(static_cast<uint8_t>(c)));
  const __m256 t_lo = _mm256_load_ps(table), t_hi = _mm256_load_ps(table + 8);
  const __m256i mask = _mm256_set1_epi32(kNibbles<D> ? 0x0f : 0xff), seven = _mm256_set1_epi32(7);
  for (int q = 0; q < 4; ++q) {
    const int k = kin + 4 * q;  // packed row of K-values k..k + 3
    int row = k / 4, shift = 0;
    if constexpr (kNibbles<D>)
      if (k >= group / 2) row -= group / 8, shift = 4;
    for (int h = 0; h < 2; ++h) {  // channels 8h..8h + 7
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + row * 64 + 32 * h));
      const __m256 vs = _mm256_load_ps(scale + 8 * h), vo = _mm256_load_ps(offset + 8 * h);
      __m256i bits[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i code = _mm256_and_si256(_mm256_srli_epi32(v, 8 * j + shift), mask);
        __m256 value;
        if constexpr (kNibbles<D>) {
          value = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t_lo, code), _mm256_permutevar8x32_ps(t_hi, code),
                                   _mm256_castsi256_ps(_mm256_cmpgt_epi32(code, seven)));
        } else {
          value = _mm256_cvtepi32_ps(_mm256_sub_epi32(code, _mm256_set1_epi32(128)));
        }
        const __m256i b = _mm256_castps_si256(_mm256_fmadd_ps(value, vs, vo));
        const __m256i round = _mm256_add_epi32(
            _mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)));
        bits[j] = _mm256_srli_epi32(_mm256_add_epi32(b, round), 16);
      }
      for (int j = 0; j < 4; j += 2)  // pair rows: K-values k + j, k + j + 1 per channel
        _mm256_store_si256(reinterpret_cast<__m256i*>(stage + (2 * q + j / 2) * 32 + 16 * h),
                           _mm256_or_si256(bits[j], _mm256_slli_epi32(bits[j + 1], 16)));
    }
  }
}

// Columns [k0, k0 + 64) of W [N, K] (packed panels) as 4 bf16 panels of W^T in BF16's packed layout
// (16 output channels x pairs of reduction values per 64-byte row), reduction padded to Nr (a
// multiple of 64) with zeros. Tile by tile of 16 x 16: BF16's packed rows are read in place, other
// methods' weights are decoded to bf16 rows first (one rounding of scale * value).
template <Method M>
void decode_transposed(const uint8_t* panels, int group, int64_t N, int64_t K, int64_t k0, int64_t Nr,
                       Isa isa, uint16_t* wt) {
  const TransposeTileFn transpose = isa >= Isa::kAvx512 ? transpose_tile_avx512
                                    : isa >= Isa::kAvx2 ? transpose_tile_avx2
                                                        : transpose_tile_scalar;
  const int64_t pbytes = panel_bytes(M, group, K), gbytes = group_bytes(M, group);
  const int64_t panel_t = Nr * kPanelWidth;  // bf16 values per panel of W^T
  alignas(64) uint16_t stage[8 * 32];
  for (int64_t p = 0; p < N / kPanelWidth; ++p) {
    const uint8_t* panel = panels + p * pbytes;
    // W^T's rows for reduction values 16p..16p + 15: 8 rows of 32 bf16 in group (16p) / 64
    uint16_t* dst = wt + (p / 4) * 64 * kPanelWidth + (p % 4) * 8 * 32;
    for (int t = 0; t < kColBlock / kPanelWidth; ++t) {
      const int64_t k = k0 + t * kPanelWidth;
      const uint8_t* g = panel + (k / group) * gbytes;
      const int kin = static_cast<int>(k % group);
      const uint16_t* src = stage;
      if constexpr (M == Method::kBf16) {
        src = reinterpret_cast<const uint16_t*>(g) + (kin / 2) * 32;
      } else if constexpr (!std::is_void_v<typename DecoderFor<M>::type>) {
        (isa >= Isa::kAvx512 ? decode_tile_avx512<M>
         : isa >= Isa::kAvx2 ? decode_tile_avx2<M>
                             : decode_tile_scalar<M>)(g, group, kin, stage);
      } else {
        decode_tile_scalar<M>(g, group, kin, stage);
      }
      transpose(src, dst + t * panel_t);
    }
  }
  for (int j = 0; j < kColBlock / kPanelWidth; ++j)  // the reduction's zero padding
    std::fill(wt + j * panel_t + N * kPanelWidth, wt + (j + 1) * panel_t, uint16_t{0});
}

using DecodeTransposedFn = void (*)(const uint8_t*, int, int64_t, int64_t, int64_t, int64_t, Isa, uint16_t*);

template <int... Ms>
constexpr auto make_decoders(std::integer_sequence<int, Ms...>) {
  return std::array<DecodeTransposedFn, sizeof...(Ms)>{&decode_transposed<static_cast<Method>(Ms)>...};
}
constexpr auto kDecoders = make_decoders(std::make_integer_sequence<int, kNumMethods>{});

// c[i][kk] = sum_n a[i][n] W[n][k0 + kk] for kk < 64: W [N, K] packed in `method`, a's m rows bf16
// with round_up(N, 64) values (zeros past N).
void gemm_transposed(const KernelTable& table, Method method, int group, const uint8_t* panels, int64_t N,
                     int64_t K, int64_t k0, int m, const uint16_t* const* rows, float* c, int64_t ldc) {
  struct Decoded {
    AlignedVector<uint16_t> wt;
  };
  auto& sc = *thread_scratch<Decoded>();
  const int64_t Nr = round_up(N, kKAlign);
  grow(sc.wt, static_cast<size_t>(Nr * kColBlock));
  kDecoders[static_cast<int>(method)](panels, group, N, K, k0, Nr, table.isa, sc.wt.data());
  const Bf16Rows a{rows, kChunkBytes};
  table.method(Method::kBf16)
      .gemm_a16(m, Nr, kKAlign, a, reinterpret_cast<const uint8_t*>(sc.wt.data()),
                static_cast<int>(kColBlock / kPanelWidth), c, ldc);
}

struct alignas(64) PaddedCounter {
  std::atomic<int64_t> value{0};
};

template <class F>
void for_each_item(std::atomic<int64_t>& counter, int64_t n, F&& body) {
  for (int64_t i = counter.fetch_add(1, std::memory_order_relaxed); i < n;
       i = counter.fetch_add(1, std::memory_order_relaxed))
    body(i);
}

// One worker's row pointers and fp32 buffers.
struct WorkerScratch {
  std::vector<const uint16_t*> ptrs;  // kMaxCallRows
  AlignedVector<float> c;             // a GEMM's output
  AlignedVector<float> w0, w1, w2;    // adapter blocks in fp32
  AlignedVector<float> rows0, rows1;  // fp32 rows
  AlignedVector<float> grads;         // one expert's adapter gradients
};
WorkerScratch& worker_scratch() {
  auto& sc = *thread_scratch<WorkerScratch>();
  grow(sc.ptrs, kMaxCallRows);
  return sc;
}

}  // namespace

struct SftSaved {
  int64_t tokens = 0, rows = 0;
  int top_k = 0;
  std::vector<int64_t> offsets;  // [E + 1]: expert e's rows
  std::vector<int> active;       // experts with rows
  std::vector<int32_t> row_token;
  std::vector<float> row_weight;
  std::vector<int64_t> slot_row;  // [tokens * top_k], -1: nothing computed here
  AlignedVector<uint16_t> x;      // [rows, Hp] bf16
  AlignedVector<float> xa;        // [rows, 2r]: x A_gate^T, then x A_up^T
  AlignedVector<float> g, u;      // [rows, Ip]
  AlignedVector<uint16_t> h;      // [rows, Ip] bf16
  AlignedVector<float> ha;        // [rows, r]
  const SftMoe* owner = nullptr;  // the layer whose forward filled it
};

std::shared_ptr<SftSaved> make_sft_saved() {
  return std::make_shared<SftSaved>();
}

int64_t sft_saved_bytes(const SftSaved& s) {
  return static_cast<int64_t>(s.x.size() * 2 + (s.xa.size() + s.g.size() + s.u.size() + s.ha.size()) * 4 +
                              s.h.size() * 2 + s.slot_row.size() * 8 + s.row_token.size() * 8);
}

int64_t sft_saved_tokens(const SftSaved& s) {
  return s.tokens;
}

struct SftMoe::Scratch {
  std::vector<AlignedVector<float>> y;  // per pool: [rows, H16] partial outputs, then [rows, Hp] dx
  AlignedVector<uint16_t> dy;           // [rows, H64] bf16 dY rows
  AlignedVector<float> dyb;             // [rows, r]
  AlignedVector<float> dhu;             // [rows, Ip]
  AlignedVector<float> dg, du;          // [rows, Ip]
  AlignedVector<uint16_t> dgu;          // [rows, 2 Ip] bf16, each pool's blocks as its gate/up panels
  AlignedVector<float> dgub;            // [rows, 2r]
  std::vector<float> dweight;           // [rows]
  PaddedCounter counters[6][kMaxPhasePools];
  std::atomic<bool> failed{false};
};

SftMoe::SftMoe(MoeLayer& layer, const LoraConfig& config)
    : layer_(layer), config_(config), scratch_(std::make_unique<Scratch>()), unsaved_(make_sft_saved()) {
  const MoeConfig& c = layer.config();
  if (!c.glu.plain())
    throw std::invalid_argument("fine-tuning supports the SiLU-gated experts (silu(gate) * up) only");
  if (layer.has_biases()) throw std::invalid_argument("fine-tuning supports experts without biases only");
  if (!layer.holds_every_expert())
    throw std::invalid_argument(
        "fine-tuning trains every expert on the CPU: build the layer without absent experts");
  if (config.rank < 1 || config.rank > std::min(c.hidden, c.intermediate))
    throw std::invalid_argument("lora_rank " + std::to_string(config.rank) + " must be in 1.." +
                                std::to_string(std::min(c.hidden, c.intermediate)) +
                                " (the smaller of hidden_size and moe_intermediate_size)");
  if (!std::isfinite(config.alpha)) throw std::invalid_argument("lora_alpha must be finite");
  if (layer.num_pools() > kMaxPhasePools) throw std::invalid_argument("at most 64 pools");
}

SftMoe::~SftMoe() {
  drain();
}

void SftMoe::drain() const {
  layer_.runner().wait_done(last_task_);
}

void SftMoe::set_lora(const LoraTensors& tensors) {
  if (tensors.dtype != DType::kFloat32 && tensors.dtype != DType::kBFloat16)
    throw std::invalid_argument("LoRA tensors must be float32 or bfloat16");
  for (int i = 0; i < kNumLoraTensors; ++i)
    if (!tensors.weight[i] || !tensors.grad[i])
      throw std::invalid_argument("every LoRA tensor and gradient is needed");
  drain();  // a pending task reads the old pointers
  lora_ = tensors;
  has_lora_ = true;
}

uint64_t SftMoe::submit_forward(const SftForwardArgs& args, std::shared_ptr<SftSaved> save) {
  if (!layer_.loaded()) throw std::runtime_error("load the layer's weights before a forward");
  if (args.tokens < 1) throw std::invalid_argument("a forward needs at least one token");
  const MoeConfig& c = layer_.config();
  check_expert_ids(args.expert_ids, args.ids_int64, args.tokens, c.top_k, c.num_experts);
  std::shared_ptr<SftSaved> saved = save ? std::move(save) : unsaved_;
  saved->owner = this;
  last_task_ = layer_.runner().submit(
      [this, args, saved](const WorkerContext& ctx) { forward_task(args, *saved, ctx); });
  return last_task_;
}

uint64_t SftMoe::submit_backward(std::shared_ptr<SftSaved> saved, const SftBackwardArgs& args) {
  if (!saved || saved->owner != this)
    throw std::invalid_argument("backward needs the state saved by a forward of this layer");
  last_task_ = layer_.runner().submit(
      [this, args, saved](const WorkerContext& ctx) { backward_task(args, *saved, ctx); });
  return last_task_;
}

namespace {

// Runs body, recording a failure for the runner's next sync; after one, every worker skips the
// remaining work of the task but still reaches its barriers.
template <class F>
void guarded(Runner& runner, std::atomic<bool>& failed, F&& body) {
  if (failed.load(std::memory_order_acquire)) return;
  try {
    body();
  } catch (...) {
    runner.record_error(std::current_exception());
    failed.store(true, std::memory_order_release);
  }
}

}  // namespace

namespace {

// The sizes every phase reads.
struct SftShape {
  int E, top_k, P, G, r;
  int64_t H, I, Hp, Ip, H16, width;
  float scale;    // alpha / r
  int lora_pool;  // the first pool with channels: it adds the adapters' terms of pool-split products
};

SftShape shape_of(const MoeLayer& layer, const LoraConfig& lora) {
  const MoeConfig& c = layer.config();
  SftShape d{c.num_experts,
             c.top_k,
             layer.num_pools(),
             layer.group(),
             lora.rank,
             c.hidden,
             c.intermediate,
             layer.hidden_padded(),
             layer.intermediate_padded(),
             round_up(c.hidden, kPanelWidth),
             layer.gate_up_block(),
             lora.alpha / static_cast<float>(lora.rank),
             0};
  while (d.lora_pool + 1 < d.P &&
         layer.packed_slice(d.lora_pool).i_end == layer.packed_slice(d.lora_pool).i_begin)
    ++d.lora_pool;
  return d;
}

// Rows grouped by expert: each computed (token, slot) gets one.
void route(const MoeConfig& c, const SftForwardArgs& args, SftSaved& s) {
  const int E = c.num_experts, top_k = c.top_k;
  const int64_t T = args.tokens;
  s.tokens = T, s.top_k = top_k;
  auto id_at = [&](int64_t i) -> int64_t {
    return args.ids_int64 ? static_cast<const int64_t*>(args.expert_ids)[i]
                          : static_cast<const int32_t*>(args.expert_ids)[i];
  };
  auto computed = [&](int64_t id) { return id >= 0 && !(args.skip_mask && args.skip_mask[id]); };
  std::vector<int64_t> counts(E, 0);
  for (int64_t i = 0; i < T * top_k; ++i)
    if (computed(id_at(i))) ++counts[id_at(i)];
  s.offsets.assign(E + 1, 0);
  s.active.clear();
  for (int e = 0; e < E; ++e) {
    s.offsets[e + 1] = s.offsets[e] + counts[e];
    if (counts[e]) s.active.push_back(e);
  }
  s.rows = s.offsets[E];
  s.row_token.resize(s.rows), s.row_weight.resize(s.rows);
  s.slot_row.assign(static_cast<size_t>(T * top_k), -1);
  std::vector<int64_t> fill(s.offsets.begin(), s.offsets.end() - 1);
  for (int64_t i = 0; i < T * top_k; ++i) {
    const int64_t id = id_at(i);
    if (!computed(id)) continue;
    const int64_t row = fill[id]++;
    s.slot_row[i] = row;
    s.row_token[row] = static_cast<int32_t>(i / top_k);
    s.row_weight[row] = args.weights[i];
  }
}

}  // namespace

void SftMoe::forward_task(const SftForwardArgs& args, SftSaved& s, const WorkerContext& ctx) {
  const MoeConfig& mc = layer_.config();
  const SftShape d = shape_of(layer_, config_);
  const bool lora = has_lora_;
  const LoraTensors& L = lora_;
  const GemmA16Fn gemm = layer_.kernels().method(mc.method).gemm_a16;
  Scratch& ws = *scratch_;
  Runner& runner = layer_.runner();
  const int r = d.r;

  // 1. Routing (worker 0); per expert: the gathered rows of x and x A^T of gate and up.
  if (ctx.tid == 0) {
    ws.failed.store(false);
    for (auto& phase : ws.counters)
      for (auto& counter : phase) counter.value.store(0, std::memory_order_relaxed);
    guarded(runner, ws.failed, [&] {
      route(mc, args, s);
      const int64_t R = s.rows;
      s.x.resize(R * d.Hp), s.xa.assign(R * 2 * r, 0.0f), s.g.resize(R * d.Ip), s.u.resize(R * d.Ip);
      s.h.resize(R * d.Ip), s.ha.assign(R * r, 0.0f);
      ws.y.resize(d.P);
      for (auto& y : ws.y) grow(y, static_cast<size_t>(R * d.H16));
    });
  }
  ctx.barrier();
  const int64_t nactive = static_cast<int64_t>(s.active.size());
  guarded(runner, ws.failed, [&] {
    WorkerScratch& sc = worker_scratch();
    for_each_item(ws.counters[0][0].value, nactive, [&](int64_t a) {
      const int e = s.active[a];
      const int64_t r0 = s.offsets[e], n = s.offsets[e + 1] - r0;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t* row = s.x.data() + (r0 + i) * d.Hp;
        std::memcpy(row, args.hidden + s.row_token[r0 + i] * d.H, d.H * 2);
        std::fill(row + d.H, row + d.Hp, uint16_t{0});
      }
      if (!lora) return;
      grow(sc.w0, 2 * r * d.H), grow(sc.rows0, d.H);
      load_f32(L.weight[kGateA], L.dtype, e * r * d.H, r, d.H, d.H, false, sc.w0.data(), d.H);
      load_f32(L.weight[kUpA], L.dtype, e * r * d.H, r, d.H, d.H, false, sc.w0.data() + r * d.H, d.H);
      for (int64_t i = 0; i < n; ++i) {
        bf16_row_to_float(s.x.data() + (r0 + i) * d.Hp, d.H, sc.rows0.data());
        gemm_nt(1, 2 * r, d.H, 1.0f, sc.rows0.data(), d.H, sc.w0.data(), d.H, s.xa.data() + (r0 + i) * 2 * r,
                2 * r);
      }
    });
  });
  ctx.barrier();

  // 2. Gate and up per pool and run of blocks of intermediate channels (+ s xa B^T), then h. A run
  // of blocks is one GEMM call: one pass over the expert's rows for several blocks' weights.
  guarded(runner, ws.failed, [&] {
    const MoeLayer::PackedSlice ps = layer_.packed_slice(ctx.pool);
    const int64_t blocks = (ps.i_end - ps.i_begin) / d.width;
    const int64_t runs = (blocks + kGateUpRunBlocks - 1) / kGateUpRunBlocks;
    const int64_t panel = panel_bytes(mc.method, d.G, d.Hp);
    WorkerScratch& sc = worker_scratch();
    grow(sc.c, kMaxCallRows * 2 * d.width * kGateUpRunBlocks),
        grow(sc.w0, 2 * r * d.width * kGateUpRunBlocks);
    for_each_item(ws.counters[1][ctx.pool].value, nactive * runs, [&](int64_t item) {
      const int e = s.active[item / runs];
      const int64_t b0 = item % runs * kGateUpRunBlocks, nb = std::min(kGateUpRunBlocks, blocks - b0);
      const int64_t i0 = ps.i_begin + b0 * d.width, cols = nb * d.width, ldc = 2 * cols;
      float* bt_gate = sc.w0.data();  // B's rows [i0, i0 + cols) transposed, [r, cols], zero past I
      float* bt_up = sc.w0.data() + r * cols;
      if (lora) {
        const int64_t lora_rows = std::clamp<int64_t>(d.I - i0, 0, cols);
        std::fill(sc.w0.begin(), sc.w0.begin() + 2 * r * cols, 0.0f);
        load_f32(L.weight[kGateB], L.dtype, (e * d.I + i0) * r, lora_rows, r, r, true, bt_gate, cols);
        load_f32(L.weight[kUpB], L.dtype, (e * d.I + i0) * r, lora_rows, r, r, true, bt_up, cols);
      }
      const uint8_t* w = ps.gate_up + e * ps.gate_up_bytes + b0 * 2 * (d.width / kPanelWidth) * panel;
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0));
        for (int i = 0; i < m; ++i) sc.ptrs[i] = s.x.data() + (r0 + i) * d.Hp;
        gemm(m, d.Hp, d.G, Bf16Rows{sc.ptrs.data(), kChunkBytes}, w, static_cast<int>(ldc / kPanelWidth),
             sc.c.data(), ldc);
        const float* xa = s.xa.data() + r0 * 2 * r;
        for (int64_t bb = 0; bb < nb; ++bb) {
          float* cg = sc.c.data() + bb * 2 * d.width;  // the block's gate columns, then its up columns
          if (lora) {
            gemm_nn(m, d.width, r, d.scale, xa, 2 * r, bt_gate + bb * d.width, cols, cg, ldc);
            gemm_nn(m, d.width, r, d.scale, xa + r, 2 * r, bt_up + bb * d.width, cols, cg + d.width, ldc);
          }
          for (int i = 0; i < m; ++i) {
            const int64_t at = (r0 + i) * d.Ip + i0 + bb * d.width;
            std::memcpy(s.g.data() + at, cg + i * ldc, d.width * 4);
            std::memcpy(s.u.data() + at, cg + i * ldc + d.width, d.width * 4);
            layer_.kernels().silu_mul(s.g.data() + at, s.u.data() + at, d.width, s.h.data() + at);
          }
        }
      }
    });
  });
  ctx.barrier();

  // 3. ha = h A_down^T per expert.
  if (lora)
    guarded(runner, ws.failed, [&] {
      WorkerScratch& sc = worker_scratch();
      grow(sc.w0, r * d.I), grow(sc.rows0, d.I);
      for_each_item(ws.counters[2][0].value, nactive, [&](int64_t a) {
        const int e = s.active[a];
        load_f32(L.weight[kDownA], L.dtype, e * r * d.I, r, d.I, d.I, false, sc.w0.data(), d.I);
        for (int64_t row = s.offsets[e]; row < s.offsets[e + 1]; ++row) {
          bf16_row_to_float(s.h.data() + row * d.Ip, d.I, sc.rows0.data());
          gemm_nt(1, r, d.I, 1.0f, sc.rows0.data(), d.I, sc.w0.data(), d.I, s.ha.data() + row * r, r);
        }
      });
    });
  ctx.barrier();

  // 4. Down per pool and run of output panels: each pool's partial y (+ s ha B_down^T on one pool).
  guarded(runner, ws.failed, [&] {
    const MoeLayer::PackedSlice ps = layer_.packed_slice(ctx.pool);
    const int64_t slice = ps.i_end - ps.i_begin;
    if (slice == 0) return;
    const int64_t panels = d.H16 / kPanelWidth, runs = (panels + kDownRunPanels - 1) / kDownRunPanels;
    const int64_t panel = panel_bytes(mc.method, d.G, slice);
    const bool add_lora = lora && ctx.pool == d.lora_pool;
    float* y = ws.y[ctx.pool].data();
    WorkerScratch& sc = worker_scratch();
    grow(sc.w0, r * kDownRunPanels * kPanelWidth);
    for_each_item(ws.counters[3][ctx.pool].value, nactive * runs, [&](int64_t item) {
      const int e = s.active[item / runs];
      const int64_t p0 = item % runs * kDownRunPanels, np = std::min<int64_t>(kDownRunPanels, panels - p0);
      const int64_t c0 = p0 * kPanelWidth, cols = np * kPanelWidth;
      if (add_lora) {  // B_down's rows [c0, c0 + cols) transposed, [r, cols], zero past H
        std::fill(sc.w0.begin(), sc.w0.begin() + r * cols, 0.0f);
        load_f32(L.weight[kDownB], L.dtype, (e * d.H + c0) * r, std::clamp<int64_t>(d.H - c0, 0, cols), r, r,
                 true, sc.w0.data(), cols);
      }
      const uint8_t* w = ps.down + e * ps.down_bytes + p0 * panel;
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0));
        for (int i = 0; i < m; ++i) sc.ptrs[i] = s.h.data() + (r0 + i) * d.Ip + ps.i_begin;
        float* out = y + r0 * d.H16 + c0;
        gemm(m, slice, d.G, Bf16Rows{sc.ptrs.data(), kChunkBytes}, w, static_cast<int>(np), out, d.H16);
        if (add_lora) gemm_nn(m, cols, r, d.scale, s.ha.data() + r0 * r, r, sc.w0.data(), cols, out, d.H16);
      }
    });
  });
  ctx.barrier();

  // 5. out[t] = sum over the token's rows, in slot order, of weight * (sum of the pools' parts).
  guarded(runner, ws.failed, [&] {
    WorkerScratch& sc = worker_scratch();
    grow(sc.rows0, d.H);
    const int64_t T = s.tokens, per_item = 8;
    for_each_item(ws.counters[4][0].value, (T + per_item - 1) / per_item, [&](int64_t item) {
      for (int64_t t = item * per_item; t < std::min(T, (item + 1) * per_item); ++t) {
        std::fill(sc.rows0.begin(), sc.rows0.begin() + d.H, 0.0f);
        for (int k = 0; k < d.top_k; ++k) {
          const int64_t row = s.slot_row[t * d.top_k + k];
          if (row < 0) continue;
          for (int p = 0; p < d.P; ++p)
            if (layer_.packed_slice(p).i_end > layer_.packed_slice(p).i_begin)
              layer_.kernels().add_weighted(sc.rows0.data(), ws.y[p].data() + row * d.H16, s.row_weight[row],
                                            d.H);
        }
        for (int64_t j = 0; j < d.H; ++j) args.out[t * d.H + j] = float_to_bf16(sc.rows0[j]);
      }
    });
  });
}

void SftMoe::backward_task(const SftBackwardArgs& args, const SftSaved& s, const WorkerContext& ctx) {
  const MoeConfig& mc = layer_.config();
  const SftShape d = shape_of(layer_, config_);
  const bool lora = has_lora_ && !config_.skip_lora;
  const LoraTensors& L = lora_;
  const KernelTable& table = layer_.kernels();
  Scratch& ws = *scratch_;
  Runner& runner = layer_.runner();
  const int r = d.r;
  const int64_t R = s.rows, nactive = static_cast<int64_t>(s.active.size());

  if (ctx.tid == 0) {
    ws.failed.store(false);
    for (auto& phase : ws.counters)
      for (auto& counter : phase) counter.value.store(0, std::memory_order_relaxed);
    guarded(runner, ws.failed, [&] {
      ws.dy.resize(R * d.Hp), ws.dyb.assign(R * r, 0.0f), ws.dhu.resize(R * d.Ip);
      ws.dg.resize(R * d.Ip), ws.du.resize(R * d.Ip), ws.dgu.resize(R * 2 * d.Ip);
      ws.dgub.assign(R * 2 * r, 0.0f), ws.dweight.assign(R, 0.0f);
      ws.y.resize(d.P);
      for (auto& y : ws.y) grow(y, static_cast<size_t>(R * d.Hp));
    });
  }
  ctx.barrier();

  // 1. Gather dY per row; dyb = dY B_down.
  guarded(runner, ws.failed, [&] {
    WorkerScratch& sc = worker_scratch();
    for_each_item(ws.counters[0][0].value, nactive, [&](int64_t a) {
      const int e = s.active[a];
      for (int64_t row = s.offsets[e]; row < s.offsets[e + 1]; ++row) {
        uint16_t* dst = ws.dy.data() + row * d.Hp;
        std::memcpy(dst, args.grad_out + s.row_token[row] * d.H, d.H * 2);
        std::fill(dst + d.H, dst + d.Hp, uint16_t{0});
      }
      if (!lora) return;
      grow(sc.w0, d.H * r), grow(sc.rows0, d.H);
      load_f32(L.weight[kDownB], L.dtype, e * d.H * r, d.H, r, r, true, sc.w0.data(), d.H);  // [r, H]
      for (int64_t row = s.offsets[e]; row < s.offsets[e + 1]; ++row) {
        bf16_row_to_float(ws.dy.data() + row * d.Hp, d.H, sc.rows0.data());
        gemm_nt(1, r, d.H, 1.0f, sc.rows0.data(), d.H, sc.w0.data(), d.H, ws.dyb.data() + row * r, r);
      }
    });
  });
  ctx.barrier();

  // 2. dhu = dY W_down + s dyb A_down, per pool and 64 intermediate channels.
  guarded(runner, ws.failed, [&] {
    const MoeLayer::PackedSlice ps = layer_.packed_slice(ctx.pool);
    const int64_t slice = ps.i_end - ps.i_begin, blocks = slice / kColBlock;
    WorkerScratch& sc = worker_scratch();
    grow(sc.w0, r * kColBlock);
    for_each_item(ws.counters[1][ctx.pool].value, nactive * blocks, [&](int64_t item) {
      const int e = s.active[item / blocks];
      const int64_t k0 = item % blocks * kColBlock, col0 = ps.i_begin + k0;
      if (lora) {
        std::fill(sc.w0.begin(), sc.w0.begin() + r * kColBlock, 0.0f);
        load_f32(L.weight[kDownA], L.dtype, e * r * d.I + col0, r,
                 std::clamp<int64_t>(d.I - col0, 0, kColBlock), d.I, false, sc.w0.data(), kColBlock);
      }
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0));
        for (int i = 0; i < m; ++i) sc.ptrs[i] = ws.dy.data() + (r0 + i) * d.Hp;
        float* out = ws.dhu.data() + r0 * d.Ip + col0;
        gemm_transposed(table, mc.method, d.G, ps.down + e * ps.down_bytes, d.H16, slice, k0, m,
                        sc.ptrs.data(), out, d.Ip);
        if (lora)
          gemm_nn(m, kColBlock, r, d.scale, ws.dyb.data() + r0 * r, r, sc.w0.data(), kColBlock, out, d.Ip);
      }
    });
  });
  ctx.barrier();

  // 3. Per expert: d weight, dg and du, the adapters' gradients, dgb and dub.
  guarded(runner, ws.failed, [&] {
    WorkerScratch& sc = worker_scratch();
    const int64_t H = d.H, I = d.I, Ip = d.Ip;
    // One expert's gradients: A_gate, A_up [r, H]; B_gate, B_up, B_down transposed, [r, I] and [r, H];
    // A_down [r, I].
    const int64_t grad_at[kNumLoraTensors + 1] = {0,
                                                  r * H,
                                                  r * H + I * r,
                                                  2 * r * H + I * r,
                                                  2 * r * H + 2 * I * r,
                                                  2 * r * H + 2 * I * r + r * I,
                                                  2 * r * H + 2 * I * r + r * I + H * r};
    const int64_t grad_offset[kNumLoraTensors] = {r * H, I * r, r * H, I * r, r * I, H * r};  // per expert
    for_each_item(ws.counters[2][0].value, nactive, [&](int64_t a) {
      const int e = s.active[a];
      grow(sc.grads, grad_at[kNumLoraTensors]);
      if (lora) {
        std::fill(sc.grads.begin(), sc.grads.begin() + grad_at[kNumLoraTensors], 0.0f);
        grow(sc.w1, 2 * I * r);  // B_gate, B_up transposed, [r, I] each
        load_f32(L.weight[kGateB], L.dtype, e * I * r, I, r, r, true, sc.w1.data(), I);
        load_f32(L.weight[kUpB], L.dtype, e * I * r, I, r, r, true, sc.w1.data() + I * r, I);
      }
      float* g_ga = sc.grads.data() + grad_at[kGateA];
      float* g_gb = sc.grads.data() + grad_at[kGateB];
      float* g_ua = sc.grads.data() + grad_at[kUpA];
      float* g_ub = sc.grads.data() + grad_at[kUpB];
      float* g_da = sc.grads.data() + grad_at[kDownA];
      float* g_db = sc.grads.data() + grad_at[kDownB];
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int64_t m = std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0);
        grow(sc.rows0, m * std::max(Ip, H)), grow(sc.rows1, m * std::max(Ip, H));
        grow(sc.c, std::max<int64_t>(kMaxCallRows * r, 2 * Ip));
        float* hf = sc.rows0.data();  // h rows, fp32 [m, Ip]
        for (int64_t i = 0; i < m; ++i) {
          const int64_t row = r0 + i;
          bf16_row_to_float(s.h.data() + row * Ip, Ip, hf + i * Ip);
          const float* dhu = ws.dhu.data() + row * Ip;
          float dw = 0.0f;
          for (int64_t j = 0; j < Ip; ++j) dw += dhu[j] * hf[i * Ip + j];
          ws.dweight[row] = dw;
          const float w = s.row_weight[row];
          float* dh = sc.c.data();
          for (int64_t j = 0; j < Ip; ++j) dh[j] = w * dhu[j];
          float* dg = ws.dg.data() + row * Ip;
          float* du = ws.du.data() + row * Ip;
          silu_mul_backward(s.g.data() + row * Ip, s.u.data() + row * Ip, dh, Ip, dg, du);
          uint16_t* dgu = ws.dgu.data() + row * 2 * Ip;  // blocks as the packed gate/up: gate's, then up's
          for (int64_t b = 0; b < Ip; b += d.width)
            for (int64_t j = 0; j < d.width; ++j) {
              dgu[2 * b + j] = float_to_bf16(dg[b + j]);
              dgu[2 * b + d.width + j] = float_to_bf16(du[b + j]);
            }
        }
        if (!lora) continue;
        // Down: dA += s (w dyb)^T h, dB += s (w dY)^T ha.
        float* wdyb = sc.c.data();
        float* wdy = sc.rows1.data();
        for (int64_t i = 0; i < m; ++i) {
          const float w = s.row_weight[r0 + i];
          for (int j = 0; j < r; ++j) wdyb[i * r + j] = w * ws.dyb[(r0 + i) * r + j];
          bf16_row_to_float(ws.dy.data() + (r0 + i) * d.Hp, H, wdy + i * H);
          for (int64_t j = 0; j < H; ++j) wdy[i * H + j] *= w;
        }
        gemm_tn(r, I, m, d.scale, wdyb, r, hf, Ip, g_da, I);
        gemm_tn(r, H, m, d.scale, s.ha.data() + r0 * r, r, wdy, H, g_db, H);  // transposed, [r, H]
        // Gate and up: dB += s dg^T xa, dgb = dg B, dA += s dgb^T x.
        const float* dg = ws.dg.data() + r0 * Ip;
        const float* du = ws.du.data() + r0 * Ip;
        const float* xa = s.xa.data() + r0 * 2 * r;
        float* dgub = ws.dgub.data() + r0 * 2 * r;
        gemm_tn(r, I, m, d.scale, xa, 2 * r, dg, Ip, g_gb, I);  // transposed, [r, I]
        gemm_tn(r, I, m, d.scale, xa + r, 2 * r, du, Ip, g_ub, I);
        gemm_nt(m, r, I, 1.0f, dg, Ip, sc.w1.data(), I, dgub, 2 * r);
        gemm_nt(m, r, I, 1.0f, du, Ip, sc.w1.data() + I * r, I, dgub + r, 2 * r);
        float* xf = sc.rows1.data();  // x rows, fp32 [m, H]
        for (int64_t i = 0; i < m; ++i) bf16_row_to_float(s.x.data() + (r0 + i) * d.Hp, H, xf + i * H);
        gemm_tn(r, H, m, d.scale, dgub, 2 * r, xf, H, g_ga, H);
        gemm_tn(r, H, m, d.scale, dgub + r, 2 * r, xf, H, g_ua, H);
      }
      if (lora)
        for (int t = 0; t < kNumLoraTensors; ++t) {
          const bool transposed = t == kGateB || t == kUpB || t == kDownB;  // computed as [r, rows]
          add_into(L.grad[t], L.dtype, e * grad_offset[t], sc.grads.data() + grad_at[t], grad_offset[t],
                   transposed ? r : 0);
        }
    });
  });
  ctx.barrier();

  // 4. dx = dg W_gate + du W_up (+ s (dgb A_gate + dub A_up) on one pool), per pool and 64 hidden
  // channels.
  guarded(runner, ws.failed, [&] {
    const MoeLayer::PackedSlice ps = layer_.packed_slice(ctx.pool);
    const int64_t slice = ps.i_end - ps.i_begin, blocks = d.Hp / kColBlock;
    if (slice == 0) return;
    const bool add_lora = lora && ctx.pool == d.lora_pool;
    float* dx = ws.y[ctx.pool].data();
    WorkerScratch& sc = worker_scratch();
    grow(sc.w0, 2 * r * kColBlock);
    for_each_item(ws.counters[3][ctx.pool].value, nactive * blocks, [&](int64_t item) {
      const int e = s.active[item / blocks];
      const int64_t k0 = item % blocks * kColBlock;
      if (add_lora) {
        const int64_t cols = std::clamp<int64_t>(d.H - k0, 0, kColBlock);
        std::fill(sc.w0.begin(), sc.w0.begin() + 2 * r * kColBlock, 0.0f);
        load_f32(L.weight[kGateA], L.dtype, e * r * d.H + k0, r, cols, d.H, false, sc.w0.data(), kColBlock);
        load_f32(L.weight[kUpA], L.dtype, e * r * d.H + k0, r, cols, d.H, false, sc.w0.data() + r * kColBlock,
                 kColBlock);
      }
      for (int64_t r0 = s.offsets[e]; r0 < s.offsets[e + 1]; r0 += kMaxCallRows) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxCallRows, s.offsets[e + 1] - r0));
        for (int i = 0; i < m; ++i) sc.ptrs[i] = ws.dgu.data() + (r0 + i) * 2 * d.Ip + 2 * ps.i_begin;
        float* out = dx + r0 * d.Hp + k0;
        gemm_transposed(table, mc.method, d.G, ps.gate_up + e * ps.gate_up_bytes, 2 * slice, d.Hp, k0, m,
                        sc.ptrs.data(), out, d.Hp);
        if (add_lora) {
          const float* dgub = ws.dgub.data() + r0 * 2 * r;
          gemm_nn(m, kColBlock, r, d.scale, dgub, 2 * r, sc.w0.data(), kColBlock, out, d.Hp);
          gemm_nn(m, kColBlock, r, d.scale, dgub + r, 2 * r, sc.w0.data() + r * kColBlock, kColBlock, out,
                  d.Hp);
        }
      }
    });
  });
  ctx.barrier();

  // 5. Per token: grad_in = the sum of its rows' dx (slot order, then pools), its slots' d weight.
  guarded(runner, ws.failed, [&] {
    const int64_t T = s.tokens, per_item = 8;
    for_each_item(ws.counters[4][0].value, (T + per_item - 1) / per_item, [&](int64_t item) {
      for (int64_t t = item * per_item; t < std::min(T, (item + 1) * per_item); ++t) {
        float* gi = args.grad_in + t * d.H;
        std::fill(gi, gi + d.H, 0.0f);
        for (int k = 0; k < d.top_k; ++k) {
          const int64_t row = s.slot_row[t * d.top_k + k];
          args.grad_weights[t * d.top_k + k] = row < 0 ? 0.0f : ws.dweight[row];
          if (row < 0) continue;
          for (int p = 0; p < d.P; ++p)
            if (layer_.packed_slice(p).i_end > layer_.packed_slice(p).i_begin)
              layer_.kernels().add_weighted(gi, ws.y[p].data() + row * d.Hp, 1.0f, d.H);
        }
      }
    });
  });
}

}  // namespace kt
