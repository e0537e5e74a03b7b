#include "kt/membench.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>

#include "kt/topology.h"

namespace kt {

namespace {

// Eight independent sums so the loop is bound by loads, not by an add chain.
__attribute__((target_clones("avx512f", "avx2", "default"))) uint64_t sum_words(const uint64_t* p, size_t n) {
  uint64_t s[8] = {};
  for (size_t i = 0; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += p[i + j];
  uint64_t total = 0;
  for (uint64_t v : s) total += v;
  return total;
}

}  // namespace

double measure_read_bandwidth(size_t bytes, const std::vector<int>& cpus, int repeats) {
  const size_t threads = std::max<size_t>(1, cpus.size());
  const size_t words = bytes / 8 / threads / 8 * 8;
  // On 2 MiB pages like the weights it is compared with (topology.cpp): on 4 KiB pages Zen 4's 2
  // threads read ~32 GB/s with jumps to 47, on 2 MiB pages a steady 35-37.
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t buffer_bytes = (words * threads * 8 + kHugePage - 1) / kHugePage * kHugePage;
  std::unique_ptr<uint64_t, decltype(&std::free)> buffer(
      static_cast<uint64_t*>(std::aligned_alloc(kHugePage, buffer_bytes)), &std::free);
  if (!buffer) throw std::bad_alloc();
  madvise(buffer.get(), buffer_bytes, MADV_HUGEPAGE);
  std::vector<std::thread> pool;
  std::atomic<int> ready{0}, go{-1}, done{0};
  std::atomic<uint64_t> sink{0};
  double best = 0.0;
  for (size_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      if (!cpus.empty()) bind_current_thread(cpus[t]);
      uint64_t* mine = buffer.get() + t * words;
      std::memset(mine, 1, words * 8);  // first touch by the thread that reads it
      ready.fetch_add(1);
      for (int r = 0; r < repeats; ++r) {
        while (go.load() < r) std::this_thread::yield();
        sink.fetch_add(sum_words(mine, words));
        done.fetch_add(1);
      }
    });
  while (ready.load() < static_cast<int>(threads)) std::this_thread::yield();
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    go.store(r);
    while (done.load() < static_cast<int>(threads) * (r + 1)) std::this_thread::yield();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(words * 8 * threads) / s / 1e9);
  }
  for (auto& th : pool) th.join();
  return sink.load() == 42 ? best + 0.0 : best;  // sink keeps the sums alive
}

}  // namespace kt
