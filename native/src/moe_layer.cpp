#include "kt/moe_layer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "forward/forward.h"
#include "forward/workspace.h"
#include "kt/kernels.h"
#include "kt/packing.h"
#include "kt/quantize.h"
#include "kt/topology.h"
#include "work_items.h"

namespace kt {

namespace {

constexpr int kMaxPools = 64;

}  // namespace

// One pool's slice [i_begin, i_end) of every expert. Gate and up are interleaved per group of
// intermediate channels (the group's gate panels, then its up panels) so that one kernel call
// computes both from one pass over the activations.
struct MoeLayer::PoolWeights {
  int node = 0;
  int64_t i_begin = 0, i_end = 0;
  PackRegion gate_region, down_region;
  int64_t gate_up_bytes = 0, down_bytes = 0;  // per expert
  size_t gate_up_alloc = 0, down_alloc = 0;   // all experts, on the pool's node
  uint8_t* gate_up = nullptr;
  uint8_t* down = nullptr;
  bool mapped = false;  // gate_up and down point into the layer's MappedFile
  ~PoolWeights() { release(); }
  void release() {
    if (!mapped) free_on_node(gate_up, gate_up_alloc), free_on_node(down, down_alloc);
    gate_up = down = nullptr;
  }
};

struct MappedFile {
  void* base = nullptr;
  size_t bytes = 0;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(void* b, size_t n) : base(b), bytes(n) {}
  ~MappedFile();
  const uint8_t* at(int64_t offset) const { return static_cast<const uint8_t*>(base) + offset; }
};

std::shared_ptr<MoeWorkspace> make_workspace() {
  return std::make_shared<MoeWorkspace>();
}

MoeLayer::MoeLayer(const MoeConfig& config, std::shared_ptr<Runner> runner,
                   std::shared_ptr<MoeWorkspace> workspace, Isa isa)
    : config_(config),
      runner_(std::move(runner)),
      workspace_(std::move(workspace)),
      table_(kernel_table(isa)) {
  weight_prefetch_bytes();  // an invalid KT_SGLANG_PREFETCH_BYTES fails here, not in a worker
  // Each projection's group: the one given, else its method's default; one its kernels take.
  auto resolve_group = [](Method method, int group, const char* projection) {
    const MethodTraits& traits = method_traits(method);
    const int g = group == 0 ? traits.default_group : group;
    if (!group_allowed(method, g)) {
      std::string allowed;
      for (int a : traits.allowed_groups)
        if (a) allowed += (allowed.empty() ? "" : ", ") + std::to_string(a);
      throw std::invalid_argument(std::string(projection) + "group size " + std::to_string(g) +
                                  " is not allowed for " + traits.name + ": use " + allowed);
    }
    return g;
  };
  group_ = resolve_group(config_.method, config_.group, "");
  if (!config_.down_method) config_.down_method = config_.method, config_.down_group = group_;
  config_.down_group = resolve_group(*config_.down_method, config_.down_group, "down projection: ");
  if (config_.num_experts < 1 || config_.top_k < 1 || config_.top_k > config_.num_experts)
    throw std::invalid_argument("need 1 <= top_k <= num_experts");
  if (config_.hidden < 1 || config_.intermediate < 1)
    throw std::invalid_argument("hidden_size and intermediate_size must be positive");
  if (config_.max_chunk_tokens < 1) throw std::invalid_argument("max_chunk_tokens must be positive");
  if (runner_->num_pools() > kMaxPools) throw std::invalid_argument("at most 64 pools");
  const GluConfig& glu = config_.glu;
  if (glu.kind != GluKind::kSilu && glu.kind != GluKind::kSwigluOai)
    throw std::invalid_argument("unknown activation kind " + std::to_string(static_cast<int>(glu.kind)));
  if (!(glu.limit >= 0.0f) || !std::isfinite(glu.limit) || !std::isfinite(glu.alpha))
    throw std::invalid_argument("activation limit must be finite and >= 0 (0: none), alpha finite");
  config_.group = group_;
  const int64_t unit = std::max<int64_t>({group_, config_.down_group, kKAlign});
  hidden_padded_ = round_up(config_.hidden, unit);
  const int64_t units = round_up(config_.intermediate, unit) / unit;
  intermediate_padded_ = units * unit;
  const int P = runner_->num_pools();
  const int64_t E = config_.num_experts;
  if (!config_.absent.empty() && static_cast<int64_t>(config_.absent.size()) != E)
    throw std::invalid_argument("the mask of absent experts has " + std::to_string(config_.absent.size()) +
                                " entries; num_experts is " + std::to_string(E));
  storage_.assign(E, -1);
  for (int64_t e = 0; e < E; ++e)
    if (config_.absent.empty() || !config_.absent[e]) storage_[e] = held_++;
  for (int p = 0; p < P; ++p) {
    auto pw = std::make_unique<PoolWeights>();
    pw->node = runner_->pool(p).node;
    pw->i_begin = units * p / P * unit;
    pw->i_end = units * (p + 1) / P * unit;
    const int64_t slice = pw->i_end - pw->i_begin;
    pw->gate_region = {pw->i_begin, slice, 0, hidden_padded_};
    pw->down_region = {0, round_up(config_.hidden, kPanelWidth), pw->i_begin, slice};
    pw->gate_up_bytes = 2 * packed_matrix_bytes(config_.method, group_, pw->gate_region);
    pw->down_bytes = packed_matrix_bytes(*config_.down_method, config_.down_group, pw->down_region);
    pw->gate_up_alloc = static_cast<size_t>(pw->gate_up_bytes * held_);
    pw->down_alloc = static_cast<size_t>(pw->down_bytes * held_);
    pw->gate_up = static_cast<uint8_t*>(alloc_on_node(pw->gate_up_alloc, pw->node));
    pw->down = static_cast<uint8_t*>(alloc_on_node(pw->down_alloc, pw->node));
    pools_.push_back(std::move(pw));
  }
  while (down_bias_pool_ + 1 < P && pools_[down_bias_pool_]->i_end == pools_[down_bias_pool_]->i_begin)
    ++down_bias_pool_;
}

MoeLayer::~MoeLayer() {
  drain();
}

void MoeLayer::drain() const {
  runner_->wait_done(last_task_.load(std::memory_order_acquire));
}

int64_t MoeLayer::packed_bytes() const {
  int64_t total = 0;
  for (const auto& p : pools_) total += (p->gate_up_bytes + p->down_bytes) * held_;
  return total;
}

std::vector<std::pair<int64_t, int64_t>> MoeLayer::pool_slices() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& p : pools_) out.emplace_back(p->i_begin, p->i_end);
  return out;
}

MoeLayer::PackedSlice MoeLayer::packed_slice(int pool) const {
  const PoolWeights& pw = *pools_.at(pool);
  return {pw.i_begin, pw.i_end, pw.gate_up, pw.down, pw.gate_up_bytes, pw.down_bytes};
}

MoeLayer::Biases MoeLayer::biases() const {
  auto at = [](const std::vector<float>& b) { return b.empty() ? nullptr : b.data(); };
  return {at(gate_bias_), at(up_bias_), at(down_bias_), down_bias_pool_};
}

bool MoeLayer::holds_every_expert() const {
  for (int64_t e = 0; e < config_.num_experts; ++e)
    if (storage_[e] != e) return false;
  return true;
}

void MoeLayer::check_not_mapped() const {
  if (mapping_)
    throw std::logic_error(
        "this layer computes from a mapped packed file: build a new layer to load other weights");
}

void MoeLayer::pack_expert(int slot, const CanonicalMatrix& gate, const CanonicalMatrix& up,
                           const CanonicalMatrix& down) {
  const int64_t at = storage_[slot];
  if (at < 0) return;               // held elsewhere
  const int64_t width = h_group();  // intermediate channels per interleaved block
  const int64_t panel = panel_bytes(config_.method, group_, hidden_padded_);
  for (const auto& pw : pools_) {
    uint8_t* gate_up = pw->gate_up + at * pw->gate_up_bytes;
    for (int64_t i0 = 0; i0 < pw->gate_region.rows; i0 += width) {
      const PackRegion block{pw->gate_region.row_offset + i0, width, 0, hidden_padded_};
      const int64_t npan = width / kPanelWidth;
      pack_panels(gate, block, 0, npan, gate_up);
      pack_panels(up, block, 0, npan, gate_up + npan * panel);
      gate_up += 2 * npan * panel;
    }
    const int64_t dp = pw->down_region.rows / kPanelWidth;
    if (pw->down_region.cols > 0) pack_panels(down, pw->down_region, 0, dp, pw->down + at * pw->down_bytes);
  }
}

namespace {

// Runs f; an invalid_argument it throws comes back naming the expert (and projection).
template <class F>
void with_context(int64_t expert, const char* projection, F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("expert " + std::to_string(expert) + (*projection ? " " : "") + projection +
                                ": " + e.what());
  }
}

// A canonical matrix with storage of its own.
struct OwnedCanonical {
  CanonicalMatrix m;
  std::vector<uint8_t> weight;
  std::vector<float> scales, mins;  // 4 bytes a value or group: room for every method's tables
  void reset(Method method, int64_t N, int64_t K, int group) {
    m = CanonicalMatrix{method, N, K, group};
    grow(weight, static_cast<size_t>(N * m.weight_row_bytes()));
    grow(scales, static_cast<size_t>(N * m.num_groups()));
    grow(mins, static_cast<size_t>(N * m.num_groups()));
    m.weight = weight.data(), m.scales = scales.data(), m.mins = mins.data();
  }
};

}  // namespace

void MoeLayer::load_biases(const float* gate, const float* up, const float* down) {
  drain();  // a pending forward reads the biases
  const int64_t E = config_.num_experts, I = config_.intermediate, H = config_.hidden;
  auto take = [&](const float* src, int64_t n, int64_t padded, const char* what, std::vector<float>& dst) {
    dst.clear();
    if (!src) return;
    const int64_t at = first_non_finite(src, DType::kFloat32, E * n);
    if (at >= 0) throw_non_finite(what, at / n, at % n, src[at]);
    dst.assign(static_cast<size_t>(E * padded), 0.0f);
    for (int64_t e = 0; e < E; ++e) std::copy_n(src + e * n, n, dst.data() + e * padded);
  };
  take(gate, I, intermediate_padded_, "gate bias", gate_bias_);
  take(up, I, intermediate_padded_, "up bias", up_bias_);
  take(down, H, round_up(H, kPanelWidth), "down bias", down_bias_);
}

void MoeLayer::load_dense(const void* gate, const void* up, const void* down, DType dtype,
                          int64_t source_experts, const std::vector<int64_t>& slot_to_source) {
  check_not_mapped();
  const int64_t E = config_.num_experts, I = config_.intermediate, H = config_.hidden;
  if (!slot_to_source.empty() && static_cast<int64_t>(slot_to_source.size()) != E)
    throw std::invalid_argument("physical_to_logical_map must have num_experts entries");
  for (int64_t s : slot_to_source)
    if (s < -1 || s >= source_experts)
      throw std::invalid_argument("physical_to_logical_map entry " + std::to_string(s) + " is outside the " +
                                  std::to_string(source_experts) + " source experts (-1: not in this call)");
  if (slot_to_source.empty() && source_experts < E)
    throw std::invalid_argument("weights hold fewer experts than num_experts");
  const int64_t elem = dtype == DType::kFloat32 ? 4 : 2;
  auto& counter = workspace_->load_counter.value;
  counter.store(0);
  runner_->run([&](const WorkerContext& ctx) {
    OwnedCanonical g, u, d;
    for_each_item(counter, E, [&](int64_t slot) {
      const int64_t src = slot_to_source.empty() ? slot : slot_to_source[slot];
      if (storage_[slot] < 0 || src < 0) return;  // held elsewhere, or loaded by another call
      g.reset(config_.method, I, H, group_);
      u.reset(config_.method, I, H, group_);
      d.reset(*config_.down_method, H, I, config_.down_group);
      with_context(src, "gate_proj", [&] {
        quantize_rows(static_cast<const char*>(gate) + src * I * H * elem, dtype, g.m, 0, I);
      });
      with_context(src, "up_proj", [&] {
        quantize_rows(static_cast<const char*>(up) + src * I * H * elem, dtype, u.m, 0, I);
      });
      with_context(src, "down_proj", [&] {
        quantize_rows(static_cast<const char*>(down) + src * H * I * elem, dtype, d.m, 0, H);
      });
      pack_expert(static_cast<int>(slot), g.m, u.m, d.m);
    });
  });
  loaded_ = true;
}

void MoeLayer::load_canonical(const std::vector<CanonicalMatrix>& gate,
                              const std::vector<CanonicalMatrix>& up,
                              const std::vector<CanonicalMatrix>& down, bool partial) {
  check_not_mapped();
  const int64_t E = config_.num_experts, I = config_.intermediate, H = config_.hidden;
  if (static_cast<int64_t>(gate.size()) != E || static_cast<int64_t>(up.size()) != E ||
      static_cast<int64_t>(down.size()) != E)
    throw std::invalid_argument("need one canonical gate, up and down matrix per expert");
  auto check = [&](const CanonicalMatrix& m, Method method, int group, int64_t N, int64_t K,
                   const char* what) {
    if (m.method != method || m.N != N || m.K != K || m.group != group || !m.complete())
      throw std::invalid_argument(std::string(what) + ": canonical matrix does not match the layer (method " +
                                  method_traits(method).name + ", shape [" + std::to_string(N) + ", " +
                                  std::to_string(K) + "], group " + std::to_string(group) + ")");
  };
  // Not read: the experts held elsewhere, and (partial) those this call leaves as they are.
  auto skipped = [&](int64_t e) {
    return storage_[e] < 0 || (partial && !gate[e].weight && !up[e].weight && !down[e].weight);
  };
  for (int64_t e = 0; e < E; ++e) {
    if (skipped(e)) continue;
    check(gate[e], config_.method, group_, I, H, "gate");
    check(up[e], config_.method, group_, I, H, "up");
    check(down[e], *config_.down_method, config_.down_group, H, I, "down");
  }
  auto& counter = workspace_->load_counter.value;
  counter.store(0);
  runner_->run([&](const WorkerContext&) {
    for_each_item(counter, E, [&](int64_t e) {
      if (skipped(e)) return;
      with_context(e, "gate", [&] { check_finite(gate[e]); });
      with_context(e, "up", [&] { check_finite(up[e]); });
      with_context(e, "down", [&] { check_finite(down[e]); });
      with_context(e, "", [&] { pack_expert(static_cast<int>(e), gate[e], up[e], down[e]); });
    });
  });
  loaded_ = true;
}

MappedFile::~MappedFile() {
  munmap(base, bytes);
}

namespace {

std::string errno_text(int err) {
  return std::strerror(err);
}

// Reads [p, p + n) of a file mapping into the page cache and the mapping's page tables, so that the
// first forward does not fault them in one by one.
void read_pages(const uint8_t* p, int64_t n) {
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n);
  if (n <= 0 || madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ) == 0) return;
  volatile uint8_t sink = 0;  // older kernels: touch each page
  for (uintptr_t a = begin; a < end; a += page)
    sink = sink + *reinterpret_cast<const uint8_t*>(std::max(a, reinterpret_cast<uintptr_t>(p)));
}

// Maps a file read-only at a 2 MiB boundary, so that the page cache's large folios can be mapped as
// huge pages (file offset and address agree modulo 2 MiB); MAP_FAILED with errno on failure.
void* map_on_huge_page_boundary(int fd, size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  void* reserved =
      mmap(nullptr, bytes + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) return MAP_FAILED;
  const auto start = reinterpret_cast<uintptr_t>(reserved);
  const uintptr_t aligned = (start + kHuge - 1) & ~(kHuge - 1);
  void* base = mmap(reinterpret_cast<void*>(aligned), bytes, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
  const int err = errno;
  if (base == MAP_FAILED) {
    munmap(reserved, bytes + kHuge);
    errno = err;
    return MAP_FAILED;
  }
  const uintptr_t end = aligned + round_up(bytes, sysconf(_SC_PAGESIZE));  // the reservation's tail
  if (aligned > start) munmap(reserved, aligned - start);
  if (start + bytes + kHuge > end) munmap(reinterpret_cast<void*>(end), start + bytes + kHuge - end);
  return base;
}

}  // namespace

int64_t MoeLayer::file_gate_up_bytes() const {
  return 2 * packed_matrix_bytes(config_.method, group_, {0, intermediate_padded_, 0, hidden_padded_});
}

int64_t MoeLayer::file_down_bytes() const {
  return packed_matrix_bytes(*config_.down_method, config_.down_group,
                             {0, round_up(config_.hidden, kPanelWidth), 0, intermediate_padded_});
}

template <class G, class D>
void MoeLayer::for_each_file_run(const PoolWeights& pw, G&& gate_up, D&& down) const {
  // Gate/up blocks are whole groups of intermediate channels in order: a slice is one run.
  const int64_t width = h_group();
  const int64_t block = 2 * (width / kPanelWidth) * panel_bytes(config_.method, group_, hidden_padded_);
  gate_up(pw.i_begin / width * block, int64_t{0}, pw.gate_up_bytes);
  // A down panel holds all of the intermediate dimension in groups: one run per panel.
  const int64_t group = config_.down_group, gb = group_bytes(*config_.down_method, group);
  const int64_t file_panel = intermediate_padded_ / group * gb;
  const int64_t slice = (pw.i_end - pw.i_begin) / group * gb, first = pw.i_begin / group * gb;
  if (slice == 0) return;
  for (int64_t p = 0; p < pw.down_region.rows / kPanelWidth; ++p)
    down(p * file_panel + first, p * slice, slice);
}

void MoeLayer::export_packed(int slot, uint8_t* gate_up, uint8_t* down) const {
  if (slot < 0 || slot >= config_.num_experts || storage_[slot] < 0)
    throw std::invalid_argument("export_packed: slot " + std::to_string(slot) + " is not held by this layer");
  if (!loaded_) throw std::runtime_error("export_packed before the weights were loaded");
  drain();
  const int64_t at = storage_[slot];
  for (const auto& pw : pools_)
    for_each_file_run(
        *pw,
        [&](int64_t file, int64_t pool, int64_t n) {
          std::memcpy(gate_up + file, pw->gate_up + at * pw->gate_up_bytes + pool, n);
        },
        [&](int64_t file, int64_t pool, int64_t n) {
          std::memcpy(down + file, pw->down + at * pw->down_bytes + pool, n);
        });
}

void MoeLayer::map_packed(const std::string& path, int64_t gate_up_offset, int64_t down_offset,
                          int64_t file_experts, const std::vector<int64_t>& slot_to_file) {
  check_not_mapped();
  drain();
  const int64_t E = config_.num_experts;
  const int64_t GU = file_gate_up_bytes(), D = file_down_bytes();
  if (static_cast<int64_t>(slot_to_file.size()) != E)
    throw std::invalid_argument("map_packed: need one file expert per slot (" + std::to_string(E) + ")");
  for (int64_t e = 0; e < E; ++e)
    if (storage_[e] >= 0 && (slot_to_file[e] < 0 || slot_to_file[e] >= file_experts))
      throw std::invalid_argument(path + ": slot " + std::to_string(e) + " takes expert " +
                                  std::to_string(slot_to_file[e]) + ", outside the file's " +
                                  std::to_string(file_experts));
  if (file_experts < 0 || gate_up_offset < 0 || gate_up_offset % 64 || down_offset % 64 ||
      down_offset < gate_up_offset + file_experts * GU)
    throw std::invalid_argument(path + ": the header's offsets (gate/up at " +
                                std::to_string(gate_up_offset) + ", down at " + std::to_string(down_offset) +
                                ") do not fit " + std::to_string(file_experts) + " experts of " +
                                std::to_string(GU) + " gate/up bytes on cache-line boundaries");
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + errno_text(errno));
  struct stat st{};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    throw std::runtime_error("cannot stat " + path + ": " + errno_text(err));
  }
  const int64_t need = down_offset + file_experts * D;
  if (st.st_size < need) {
    close(fd);
    throw std::invalid_argument(path + " is truncated: " + std::to_string(st.st_size) +
                                " bytes, its header's " + std::to_string(file_experts) + " experts need " +
                                std::to_string(need) + " (convert again)");
  }
  void* base = map_on_huge_page_boundary(fd, static_cast<size_t>(st.st_size));
  const int err = errno;
  close(fd);
  if (base == MAP_FAILED) throw std::runtime_error("cannot map " + path + ": " + errno_text(err));
  auto file = std::make_unique<MappedFile>(base, static_cast<size_t>(st.st_size));
  const bool in_place = pools_.size() == 1;
  // Streamed like the anonymous copies are (2 MiB pages where the page cache has them).
  if (in_place) madvise(base, file->bytes, MADV_HUGEPAGE);
  auto& counter = workspace_->load_counter.value;
  counter.store(0);
  runner_->run([&](const WorkerContext&) {
    for_each_item(counter, E, [&](int64_t e) {
      if (storage_[e] < 0) return;
      const uint8_t* gu = file->at(gate_up_offset + slot_to_file[e] * GU);
      const uint8_t* dn = file->at(down_offset + slot_to_file[e] * D);
      if (in_place) {
        read_pages(gu, GU);
        read_pages(dn, D);
        return;
      }
      const int64_t at = storage_[e];
      for (const auto& pw : pools_)
        for_each_file_run(
            *pw,
            [&](int64_t f, int64_t p, int64_t n) {
              std::memcpy(pw->gate_up + at * pw->gate_up_bytes + p, gu + f, n);
            },
            [&](int64_t f, int64_t p, int64_t n) {
              std::memcpy(pw->down + at * pw->down_bytes + p, dn + f, n);
            });
    });
  });
  if (in_place) {
    PoolWeights& pw = *pools_[0];
    pw.release();
    pw.mapped = true;
    pw.gate_up = const_cast<uint8_t*>(file->at(gate_up_offset));  // read only: kernels never write weights
    pw.down = const_cast<uint8_t*>(file->at(down_offset));
    for (int64_t e = 0; e < E; ++e)
      if (storage_[e] >= 0) storage_[e] = slot_to_file[e];
    mapping_ = std::move(file);
  }
  loaded_ = true;
}

void check_expert_ids(const void* ids, bool ids_int64, int64_t tokens, int top_k, int num_experts,
                      int64_t first_token) {
  auto first_bad = [&](const auto* v) -> int64_t {
    for (int64_t i = 0; i < tokens * top_k; ++i)
      if (v[i] < -1 || v[i] >= num_experts) return i;
    return -1;
  };
  const int64_t i =
      ids_int64 ? first_bad(static_cast<const int64_t*>(ids)) : first_bad(static_cast<const int32_t*>(ids));
  if (i < 0) return;
  const int64_t e = ids_int64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
  throw std::invalid_argument("topk_ids holds expert id " + std::to_string(e) + " at token " +
                              std::to_string(first_token + i / top_k) + ", slot " +
                              std::to_string(i % top_k) + ", outside [-1, " + std::to_string(num_experts) +
                              ") (-1 means skip)");
}

uint64_t MoeLayer::submit_forward(const ForwardArgs& args) {
  if (!loaded_) throw std::runtime_error("forward before the weights were loaded");
  if (!args.hidden || !args.expert_ids || !args.weights || !args.out == !args.out_f32)
    throw std::invalid_argument(
        "forward: null hidden_states, expert ids or weights, or not exactly one output");
  if (!args.tokens_ptr && args.tokens < 0) throw std::invalid_argument("forward: negative token count");
  if (!args.tokens_ptr)
    check_expert_ids(args.expert_ids, args.ids_int64, args.tokens, config_.top_k, config_.num_experts);
  const uint64_t id = runner_->submit(std::make_shared<ForwardTask>(*this, args, nullptr));
  // Submissions may come from CUDA's host-function thread and Python's: keep the largest id.
  uint64_t last = last_task_.load(std::memory_order_relaxed);
  while (last < id && !last_task_.compare_exchange_weak(last, id, std::memory_order_acq_rel)) {
  }
  return id;
}

}  // namespace kt
