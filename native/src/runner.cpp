#include "kt/runner.h"

#include <immintrin.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <utility>

#include "kt/env.h"
#include "kt/topology.h"

namespace kt {

namespace {

// Spins until `done()` or `microseconds` pass; true when done. It yields every 64 pauses: the
// caller woken by the task that just ended waits for a core while both workers spin (Zen 4, 2
// cores, kernel 6.18: a forward of a fully masked layer took 17 or 53-78 us from one process to
// the next, with the yield 16-18 us).
template <class F>
bool spin_until(F done, int microseconds) {
  if (microseconds <= 0) return done();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(microseconds);
  for (int i = 0;; ++i) {
    if (done()) return true;
    _mm_pause();
    if ((i & 63) == 63) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      sched_yield();
    }
  }
}

}  // namespace

int Runner::spin_microseconds() {
  // Short: on small machines the thread that feeds the engine (SGLang's scheduler) needs the cores
  // between layers.
  static const int us = static_cast<int>(
      env_integer("KT_SGLANG_SPIN_US", 50, 0, 1000000, "a spin time in microseconds (0: sleep at once)"));
  return us;
}

Runner::Runner(std::vector<PoolSpec> pools) : pools_(std::move(pools)) {
  spin_microseconds();  // an invalid KT_SGLANG_SPIN_US fails here, not in a worker
  if (pools_.empty()) throw std::invalid_argument("Runner needs at least one pool");
  int total = 0;
  for (const auto& p : pools_) {
    if (p.cpus.empty()) throw std::invalid_argument("every pool needs at least one thread");
    total += static_cast<int>(p.cpus.size());
    worker_cpus_.insert(worker_cpus_.end(), p.cpus.begin(), p.cpus.end());
    pool_barriers_.push_back(std::make_unique<SpinBarrier>(static_cast<int>(p.cpus.size())));
  }
  all_barrier_.reset(total);
  worker_tids_ = std::make_unique<std::atomic<int>[]>(total);
  barriers_reached_ = std::make_unique<std::atomic<uint64_t>[]>(total);
  pulled_ = std::make_unique<std::atomic<bool>[]>(total);
  pull_locks_ = std::make_unique<std::mutex[]>(total);
  for (int i = 0; i < total; ++i) worker_tids_[i] = 0, barriers_reached_[i] = 0, pulled_[i] = false;
  for (const auto& p : pools_) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : p.cpus) CPU_SET(cpu, &set);
    pool_cpus_.insert(pool_cpus_.end(), p.cpus.size(), set);
  }
  int tid = 0;
  for (int p = 0; p < static_cast<int>(pools_.size()); ++p)
    for (int r = 0; r < static_cast<int>(pools_[p].cpus.size()); ++r, ++tid)
      workers_.emplace_back(&Runner::worker_main, this, tid, p, r);
}

Runner::~Runner() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

uint64_t Runner::submit(Task task) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw std::runtime_error("the runner is shutting down");
    queue_.push_back(std::move(task));
    id = submitted_.fetch_add(1, std::memory_order_acq_rel) + 1;
  }
  queue_cv_.notify_one();
  return id;
}

void Runner::wait_for_completions(std::unique_lock<std::mutex>& lock, uint64_t target) {
  waiter_cpu_.store(sched_getcpu(), std::memory_order_relaxed);
  while (completed_.load() < target) {
    // Every woken caller whose target is not reached yet sets it again.
    wake_at_ = std::min(wake_at_, target);
    done_cv_.wait(lock);
  }
}

void Runner::sync(int64_t allow_pending) {
  std::exception_ptr error;
  {
    if (allow_pending < 0) throw std::invalid_argument("sync: allow_pending must be >= 0");
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t submitted = submitted_.load(), pending = static_cast<uint64_t>(allow_pending);
    wait_for_completions(lock, submitted > pending ? submitted - pending : 0);
    std::swap(error, first_error_);
  }
  if (error) std::rethrow_exception(error);
}

void Runner::wait(uint64_t id) {
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_for_completions(lock, id);
    std::swap(error, first_error_);
  }
  if (error) std::rethrow_exception(error);
}

void Runner::wait_done(uint64_t id) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_for_completions(lock, id);
}

void Runner::run(Task task) {
  wait(submit(std::move(task)));
}

void Runner::pull_laggards(int tid) {
  const uint64_t mine = barriers_reached_[tid].load(std::memory_order_seq_cst);
  const int cpu = sched_getcpu();
  if (cpu < 0) return;
  cpu_set_t here;
  CPU_ZERO(&here);
  CPU_SET(cpu, &here);
  for (int w = 0; w < num_threads(); ++w) {
    if (w == tid || barriers_reached_[w].load(std::memory_order_acquire) >= mine) continue;
    const pid_t thread = worker_tids_[w].load(std::memory_order_acquire);
    if (thread <= 0) continue;
    // The flag before the second look at the laggard's count, the laggard its count before its
    // look at the flag (both sequentially consistent): either this sees it arrived and leaves it,
    // or it sees the flag and restores itself, under the lock, after this move. A check after the
    // move instead left a laggard that restored itself in between pinned to this core for good
    // (both workers of a 2-core pool on one core: decode 2x slower).
    std::lock_guard<std::mutex> lock(pull_locks_[w]);
    if (pulled_[w].load(std::memory_order_relaxed)) continue;  // another worker moved it
    pulled_[w].store(true, std::memory_order_seq_cst);
    if (barriers_reached_[w].load(std::memory_order_seq_cst) >= mine ||
        sched_setaffinity(thread, sizeof(here), &here) != 0)
      pulled_[w].store(false, std::memory_order_relaxed);
    else
      pulls_.fetch_add(1, std::memory_order_relaxed);
  }
}

void Runner::restore_if_pulled(int tid) {
  if (!pulled_[tid].load(std::memory_order_seq_cst)) return;
  std::lock_guard<std::mutex> lock(pull_locks_[tid]);
  if (pulled_[tid].exchange(false)) sched_setaffinity(0, sizeof(cpu_set_t), &pool_cpus_[tid]);
}

int64_t Runner::pending() const {
  return static_cast<int64_t>(submitted_.load() - completed_.load());
}

void Runner::record_error(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!first_error_) first_error_ = error;
}

void Runner::worker_main(int tid, int pool, int rank) {
  // Any core of the pool, not one core per worker: a worker whose core another thread takes (on a GPU
  // host the CUDA callback thread, the Python thread spinning in synchronize) moves to a core whose
  // worker waits at a barrier, instead of holding that barrier for a scheduler tick. Two cores with one
  // busy process beside the engine (bench/bench_contention.py, Qwen3 AMXINT4 at T=1): the median call
  // went from 7-8x to 1.7-1.9x the median alone, p90 from 7-9x to 1.9-2.4x (with the barrier's short
  // spin, thread_pool.cpp); pulling only after SpinBarrier::kLongWaitUs, 1.6x and 1.7x.
  bind_current_thread_to(pools_[pool].cpus);
  worker_tids_[tid].store(static_cast<int>(gettid()), std::memory_order_release);
  int total = 0;
  for (const auto& p : pools_) total += static_cast<int>(p.cpus.size());
  const WorkerContext me{tid, pool, rank, static_cast<int>(pools_[pool].cpus.size()), total, this};
  const int spin_us = spin_microseconds();
  uint64_t seen = 0, taken = 0;
  for (;;) {
    if (tid == 0) {
      spin_until([&] { return submitted_.load(std::memory_order_acquire) > taken; }, spin_us);
      {
        std::unique_lock<std::mutex> lock(mutex_);
        queue_cv_.wait(lock, [&] { return !queue_.empty() || stopping_; });
        if (queue_.empty()) {  // stopping, nothing left to run
          stop_.store(true);
          epoch_.fetch_add(1, std::memory_order_release);
          epoch_.notify_all();
          return;
        }
        current_ = std::move(queue_.front());
        queue_.pop_front();
        ++taken;
      }
      const auto on_waiter_cpu =
          std::find(worker_cpus_.begin(), worker_cpus_.end(), waiter_cpu_.load(std::memory_order_relaxed));
      notifier_ =
          on_waiter_cpu == worker_cpus_.end() ? 0 : static_cast<int>(on_waiter_cpu - worker_cpus_.begin());
      seen = epoch_.fetch_add(1, std::memory_order_release) + 1;
      epoch_.notify_all();
    } else {
      if (!spin_until([&] { return epoch_.load(std::memory_order_acquire) != seen; }, spin_us))
        epoch_.wait(seen, std::memory_order_acquire);
      seen = epoch_.load(std::memory_order_acquire);
      if (stop_.load()) return;
    }
    const int notifier = notifier_;  // read before the end barrier: worker 0 rewrites it after
    try {
      current_(me);
    } catch (...) {
      record_error(std::current_exception());
    }
    me.barrier();  // the task's end: counted as its steps' barriers, so that it pulls laggards too
    if (tid == 0) current_ = nullptr;
    if (tid == notifier) {
      bool wake = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        wake = completed_.fetch_add(1, std::memory_order_acq_rel) + 1 >= wake_at_;
        if (wake) wake_at_ = UINT64_MAX;
      }
      if (wake) done_cv_.notify_all();
    }
  }
}

}  // namespace kt
