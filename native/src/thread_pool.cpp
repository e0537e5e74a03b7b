// Barriers and the per-worker context of the runner's pools.
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>

#include "kt/runner.h"

namespace kt {

namespace {

// generation_ is the futex word: waits with a timeout (std::atomic::wait has none) and wakes.
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, const timespec* timeout) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, timeout, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

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

void WorkerContext::barrier() const {
  runner->barriers_reached_[tid].fetch_add(1, std::memory_order_seq_cst);     // see pull_laggards
  const std::function<void()> pull = [this] { runner->pull_laggards(tid); };  // after kLongWaitUs
  runner->all_barrier_.arrive_and_wait(&pull);
  runner->restore_if_pulled(tid);
}

void WorkerContext::pool_barrier() const {
  runner->pool_barriers_[pool]->arrive_and_wait();
}

}  // namespace kt
