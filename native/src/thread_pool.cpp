// Barriers and the per-worker context of the runner's pools.
#include <immintrin.h>
#include <sched.h>

#include <cstdint>

#include "kt/runner.h"

namespace kt {

void SpinBarrier::arrive_and_wait(const std::function<void()>* before_sleep) {
  if (count_ <= 1) return;
  const uint32_t gen = generation_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
    arrived_.store(0, std::memory_order_relaxed);
    generation_.store(gen + 1, std::memory_order_release);
    generation_.notify_all();
    return;
  }
  // Spin briefly, then yield, then sleep: a worker descheduled by another thread on its core can take
  // this core once we yield it (workers may run on any core of their pool). 4096 pauses kept the core
  // ~0.3 ms per barrier; beside a busy process the layer's median call took 7-8x its time alone
  // against 1.7-1.9x with 256.
  for (int i = 0; generation_.load(std::memory_order_acquire) == gen; ++i) {
    if (i < 256) {
      _mm_pause();
    } else if (i < 256 + 64) {
      sched_yield();
    } else {
      if (i == 256 + 64 && before_sleep) (*before_sleep)();
      generation_.wait(gen, std::memory_order_acquire);
    }
  }
}

void WorkerContext::barrier() const {
  runner->barriers_reached_[tid].fetch_add(1, std::memory_order_seq_cst);  // see pull_laggards
  const std::function<void()> pull = [this] { runner->pull_laggards(tid); };
  runner->all_barrier_.arrive_and_wait(&pull);
  runner->restore_if_pulled(tid);
}

void WorkerContext::pool_barrier() const {
  runner->pool_barriers_[pool]->arrive_and_wait();
}

}  // namespace kt
