// Waits and wakes on a 32-bit atomic through the futex system call: std::atomic::wait has no
// timeout.
#pragma once

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

namespace kt {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

// Sleeps while `word` holds `expected`, at most `timeout` (none: until woken).
inline void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, const timespec* timeout) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, timeout, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Asleep on `word` while it holds `expected`, at most `timeout` (none: until woken), counted in
// `sleepers` so that the waker calls the futex only when someone sleeps.
inline void futex_sleep(std::atomic<uint32_t>& word, uint32_t expected, std::atomic<int>& sleepers,
                        const timespec* timeout) {
  sleepers.fetch_add(1, std::memory_order_seq_cst);  // before the futex's look at the word
  futex_wait(word, expected, timeout);
  sleepers.fetch_sub(1, std::memory_order_relaxed);
}

// Waits until `done()`: 256 pauses, 64 yields, then futex_sleep. A thread descheduled by another on
// its core can take this core once we yield it. With `on_long_wait`, after `long_wait_us` it runs
// that once and then sleeps without a timeout; without, it sleeps without one from the start.
template <class Done, class OnLongWait>
void spin_then_sleep(std::atomic<uint32_t>& word, uint32_t expected, std::atomic<int>& sleepers,
                     int long_wait_us, Done done, OnLongWait* on_long_wait) {
  for (int i = 0; i < 256 + 64; ++i) {
    if (done()) return;
    if (i < 256)
      _mm_pause();
    else
      sched_yield();
  }
  using Clock = std::chrono::steady_clock;
  const auto long_wait = Clock::now() + std::chrono::microseconds(long_wait_us);
  bool called = on_long_wait == nullptr;
  while (!done()) {
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
    futex_sleep(word, expected, sleepers, called ? nullptr : &left);
  }
}

}  // namespace kt
