// How the layer's tasks deal out their work and stop on a failure: loading's all-worker tasks take
// items from a shared counter (for_each_item); the step tasks' units (the forward plan, the
// fine-tuning backward) come from the runner and flag a failure so that the next step does not open.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>

#include "kt/runner.h"

namespace kt {

// Grows a scratch vector to at least n elements; never shrinks it.
template <class Vector>
void grow(Vector& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// A work-item counter on a cache line of its own.
struct alignas(64) PaddedCounter {
  std::atomic<int64_t> value{0};
};

// Takes work items [0, n) from a shared counter until none are left.
template <class F>
void for_each_item(std::atomic<int64_t>& counter, int64_t n, F&& body) {
  for (int64_t i = counter.fetch_add(1, std::memory_order_relaxed); i < n;
       i = counter.fetch_add(1, std::memory_order_relaxed))
    body(i);
}

// Runs body; a failure is recorded for the runner's next sync, then flagged in `failed` (after the
// record: a worker that stops on the flag reports second), where the task's next step and any unit
// waiting on another look.
template <class F>
void guarded(Runner& runner, std::atomic<bool>& failed, F&& body) {
  try {
    body();
  } catch (...) {
    runner.record_error(std::current_exception());
    failed.store(true, std::memory_order_release);
  }
}

}  // namespace kt
