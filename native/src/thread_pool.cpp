// The barriers of the runner's tasks.
#include <immintrin.h>
#include <sched.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

#include "futex.h"
#include "kt/runner.h"

namespace kt {

void SpinBarrier::arrive_and_wait(const std::function<void()>* on_long_wait) {
  if (count_ <= 1) return;
  const uint32_t gen = generation_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
    arrived_.store(0, std::memory_order_relaxed);
    generation_.store(gen + 1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(generation_);
    return;
  }
  // Spin briefly, then yield, then sleep: a worker descheduled by another thread on its core can take
  // this core once we yield it (workers may run on any core of their pool). 4096 pauses kept the core
  // ~0.3 ms per barrier; beside a busy process the layer's median call took 7-8x its time alone
  // against 1.7-1.9x with 256.
  for (int i = 0; i < 256 + 64; ++i) {
    if (generation_.load(std::memory_order_acquire) != gen) return;
    if (i < 256)
      _mm_pause();
    else
      sched_yield();
  }
  using Clock = std::chrono::steady_clock;
  const auto long_wait = Clock::now() + std::chrono::microseconds(kLongWaitUs);
  bool called = on_long_wait == nullptr;
  while (generation_.load(std::memory_order_acquire) == gen) {
    timespec left{};
    if (!called) {
      const auto now = Clock::now();
      if (now >= long_wait) {
        (*on_long_wait)();
        called = true;
        continue;
      }
      left.tv_nsec = std::chrono::duration_cast<std::chrono::nanoseconds>(long_wait - now).count();
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);  // before the futex's look at the word
    futex_wait(generation_, gen, called ? nullptr : &left);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }
}

}  // namespace kt
