#include "kt/runner.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include "futex.h"
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

// Nanoseconds thread `tid` of this process has spent runnable but not running (the second field of
// its schedstat), or -1 when the kernel does not say (no schedstats) or the thread is gone.
int64_t runqueue_ns(pid_t tid) {
  if (tid <= 0) return -1;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/task/%d/schedstat", static_cast<int>(tid));
  FILE* f = std::fopen(path, "r");
  if (!f) return -1;
  unsigned long long running = 0, queued = 0;
  const int read = std::fscanf(f, "%llu %llu", &running, &queued);
  std::fclose(f);
  return read == 2 ? static_cast<int64_t>(queued) : -1;
}

// A cursor's word: the step's sequence number (low 24 bits), its units and the next unit.
constexpr int kUnitBits = 20;
constexpr uint64_t kSeqMask = (uint64_t{1} << 24) - 1, kUnitMask = (uint64_t{1} << kUnitBits) - 1;
uint64_t step_seq(uint64_t step) {
  return (step >> 2) & kSeqMask;
}
uint64_t cursor_word(uint64_t step, int64_t units) {
  return step_seq(step) << (2 * kUnitBits) | static_cast<uint64_t>(units) << kUnitBits;
}
struct CursorFields {
  uint64_t seq, units, next;
};
CursorFields cursor_fields(uint64_t word) {
  return {word >> (2 * kUnitBits), (word >> kUnitBits) & kUnitMask, word & kUnitMask};
}

// An all-worker task: one step, run once by every worker.
class EachWorkerTask final : public StepTask {
 public:
  explicit EachWorkerTask(Task task) : task_(std::move(task)) {}
  bool next_step(StepShape& shape) override {
    if (opened_) return false;
    opened_ = true;
    shape.kind = StepShape::Kind::kEachWorker;
    return true;
  }
  void run_unit(int64_t, const WorkerContext& ctx) override { task_(ctx); }

 private:
  Task task_;
  bool opened_ = false;
};

}  // namespace

int Runner::spin_microseconds() {
  // Longer than the caller's work between two layers' forwards (on the 2-core Xeon, Python's ~70 us
  // per call of a CPU-only decode loop), so the next forward finds its workers awake: woken from
  // the futex they started a one-token forward 25 us after the submit instead of 2 (Qwen3 layer,
  // Q4_K GGUF: 0.96 against 0.99 ms submit to return, with 50 us). The spin yields every 64 pauses,
  // so the thread that feeds the engine still gets its core (bench_contention.py beside a busy
  // process: median 1.56-1.60x alone at 400 us, 1.53-1.65x at 50).
  static const int us = static_cast<int>(
      env_integer("KT_SGLANG_SPIN_US", 400, 0, 1000000, "a spin time in microseconds (0: sleep at once)"));
  return us;
}

Runner::Runner(std::vector<PoolSpec> pools) : pools_(std::move(pools)) {
  spin_microseconds();  // an invalid KT_SGLANG_SPIN_US fails here, not in a worker
  if (pools_.empty()) throw std::invalid_argument("Runner needs at least one pool");
  int total = 0;
  for (const auto& p : pools_) {
    if (p.cpus.empty()) throw std::invalid_argument("every pool needs at least one thread");
    total += static_cast<int>(p.cpus.size());
    pool_barriers_.push_back(std::make_unique<SpinBarrier>(static_cast<int>(p.cpus.size())));
  }
  all_barrier_.reset(total);
  worker_tids_ = std::make_unique<std::atomic<int>[]>(total);
  barriers_reached_ = std::make_unique<std::atomic<uint64_t>[]>(total);
  in_step_ = std::make_unique<std::atomic<uint64_t>[]>(total);
  each_done_ = std::make_unique<std::atomic<uint64_t>[]>(total);
  pulled_ = std::make_unique<std::atomic<bool>[]>(total);
  pull_locks_ = std::make_unique<std::mutex[]>(total);
  for (int i = 0; i < total; ++i) {
    worker_tids_[i] = 0, barriers_reached_[i] = 0, in_step_[i] = 0, each_done_[i] = 0;
    pulled_[i] = false;
  }
  cursors_ = std::make_unique<Cursor[]>(pools_.size() + 1);
  shape_.pool_units.resize(pools_.size());
  for (int p = 0; p < static_cast<int>(pools_.size()); ++p) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : pools_[p].cpus) CPU_SET(cpu, &set);
    pool_cpus_.insert(pool_cpus_.end(), pools_[p].cpus.size(), set);
    for (int r = 0; r < static_cast<int>(pools_[p].cpus.size()); ++r)
      contexts_.push_back(
          {static_cast<int>(contexts_.size()), p, r, static_cast<int>(pools_[p].cpus.size()), total, this});
  }
  for (int tid = 0; tid < total; ++tid) workers_.emplace_back(&Runner::worker_main, this, tid);
}

Runner::~Runner() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    if (!running_) {  // else the task that drains the queue stops the workers
      stop_.store(true, std::memory_order_release);
      publish((step_.load(std::memory_order_relaxed) & ~uint64_t{3}) + 4 + kIdle);
    }
  }
  for (auto& w : workers_) w.join();
}

uint64_t Runner::submit(Task task) {
  return submit(std::make_shared<EachWorkerTask>(std::move(task)));
}

uint64_t Runner::submit(std::shared_ptr<StepTask> task) {
  uint64_t id;
  bool start;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw std::runtime_error("the runner is shutting down");
    queue_.push_back(std::move(task));
    id = submitted_.fetch_add(1, std::memory_order_acq_rel) + 1;
    start = !running_;
    running_ = true;
  }
  if (start) advance();  // the runner was idle: this thread opens the task's first step
  return id;
}

void Runner::advance() {
  for (;;) {
    if (!current_) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (queue_.empty()) {
        running_ = false;
        stop_.store(stopping_, std::memory_order_release);
        publish((step_.load(std::memory_order_relaxed) & ~uint64_t{3}) + 4 + kIdle);
        return;
      }
      owned_ = std::move(queue_.front());
      queue_.pop_front();
      current_ = owned_.get();
    }
    bool more = false;
    try {
      more = current_->next_step(shape_);
      if (more) {
        const int64_t most = shape_.kind == StepShape::Kind::kPerPool
                                 ? *std::max_element(shape_.pool_units.begin(), shape_.pool_units.end())
                                 : shape_.units;
        const int64_t least = shape_.kind == StepShape::Kind::kPerPool
                                  ? *std::min_element(shape_.pool_units.begin(), shape_.pool_units.end())
                                  : shape_.units;
        if (shape_.kind != StepShape::Kind::kEachWorker && (least < 0 || most > kMaxUnits))
          throw std::logic_error("a task's step has " + std::to_string(least < 0 ? least : most) +
                                 " units, outside [0, " + std::to_string(kMaxUnits) + "]");
      }
    } catch (...) {
      record_error(std::current_exception());
      more = false;
    }
    if (!more) {
      finish_task();
      continue;
    }
    open_step();
    if (step_units_ > 0) return;
  }
}

void Runner::open_step() {
  const uint64_t serial = (step_.load(std::memory_order_relaxed) >> 2) + 1;
  const int P = num_pools();
  uint64_t kind = kAny;
  int64_t units = 0;
  switch (shape_.kind) {
    case StepShape::Kind::kAnyWorker:
      units = shape_.units;
      cursors_[P].word.store(cursor_word(serial << 2, units), std::memory_order_relaxed);
      break;
    case StepShape::Kind::kPerPool:
      kind = kPool;
      for (int p = 0; p < P; ++p) {
        units += shape_.pool_units[p];
        cursors_[p].word.store(cursor_word(serial << 2, shape_.pool_units[p]), std::memory_order_relaxed);
      }
      break;
    case StepShape::Kind::kEachWorker:
      kind = kEach;
      units = num_threads();
      break;
  }
  step_units_ = units;
  if (units == 0) return;  // skipped: nothing was published
  step_done_.store(0, std::memory_order_relaxed);
  publish(serial << 2 | kind);
}

void Runner::publish(uint64_t step) {
  step_.store(step, std::memory_order_release);  // publishes the step's cursors and counts
  step_futex_.store(static_cast<uint32_t>(step), std::memory_order_seq_cst);
  if (stop_.load(std::memory_order_relaxed) || step_sleepers_.load(std::memory_order_seq_cst) > 0)
    futex_wake_all(step_futex_);
}

void Runner::finish_task() {
  current_ = nullptr;
  owned_.reset();
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    wake = completed_.fetch_add(1, std::memory_order_acq_rel) + 1 >= wake_at_;
    if (wake) wake_at_ = UINT64_MAX;
  }
  if (wake) done_cv_.notify_all();
}

bool Runner::units_left(int pool, uint64_t step) const {
  const CursorFields f = cursor_fields(cursors_[pool].word.load(std::memory_order_seq_cst));
  return f.seq == step_seq(step) && f.next < f.units;
}

bool Runner::claim(int tid, uint64_t step, int64_t& unit) {
  Cursor& c = cursors_[(step & 3) == kPool ? contexts_[tid].pool : num_pools()];
  uint64_t w = c.word.load(std::memory_order_acquire);
  for (;;) {
    const CursorFields f = cursor_fields(w);
    if (f.seq != step_seq(step) || f.next >= f.units) return false;  // another step's, or all taken
    if (c.word.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      unit = static_cast<int64_t>(f.next);
      return true;
    }
  }
}

void Runner::run_unit(int tid, uint64_t step, int64_t unit) {
  // A claimed unit holds its step open: what the opener wrote stays until this returns.
  const int64_t units = step_units_;
  in_step_[tid].store(step, std::memory_order_relaxed);
  try {
    current_->run_unit(unit, contexts_[tid]);
  } catch (...) {
    record_error(std::current_exception());
  }
  if ((step & 3) == kEach) each_done_[tid].store(step, std::memory_order_seq_cst);
  in_step_[tid].store(0, std::memory_order_seq_cst);  // before the look at pulled_: see pull_laggards
  restore_if_pulled(tid);
  if (step_done_.fetch_add(1, std::memory_order_acq_rel) + 1 == units) advance();
}

void Runner::wait_for_step(int tid, uint64_t step) {
  // Pulled for a pool's untaken units that others took: back before waiting (a unit it runs later
  // restores it too).
  restore_if_pulled(tid);
  auto moved = [&] { return step_.load(std::memory_order_acquire) != step; };
  if ((step & 3) == kIdle) {
    if (spin_until(moved, spin_microseconds())) return;
    while (!moved()) futex_sleep(step_futex_, static_cast<uint32_t>(step), step_sleepers_, nullptr);
    return;
  }
  // Every unit is taken: a long wait pulls the workers still in the step (holding a unit; in an
  // each-worker step, not done with it; in a pool's step, idle while it has units left).
  auto pull = [&] {
    pull_laggards(tid, [&](int w) {
      return in_step_[w].load(std::memory_order_seq_cst) == step ||
             ((step & 3) == kEach && each_done_[w].load(std::memory_order_seq_cst) != step) ||
             ((step & 3) == kPool && units_left(contexts_[w].pool, step));
    });
  };
  spin_then_sleep(step_futex_, static_cast<uint32_t>(step), step_sleepers_, SpinBarrier::kLongWaitUs, moved,
                  &pull);
}

void Runner::wait_for_completions(std::unique_lock<std::mutex>& lock, uint64_t target) {
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

template <class Late>
void Runner::pull_laggards(int tid, Late&& late) {
  const int cpu = sched_getcpu();
  if (cpu < 0) return;
  cpu_set_t here;
  CPU_ZERO(&here);
  CPU_SET(cpu, &here);
  // Only a laggard that waits for a core is pulled, not one still computing a long unit (a
  // prefill's gate/up item takes milliseconds): moved, it shared this core with this worker once
  // both went on (the kernel keeps a task that just ran where it is), and 2048-token prefill lost
  // 3-6% (0.9 pulls a call). Its time on a run queue over kPullProbeUs tells which.
  thread_local std::vector<int64_t> queued;
  queued.assign(num_threads(), -1);
  bool any = false;
  for (int w = 0; w < num_threads(); ++w)
    if (w != tid && late(w))
      queued[w] = runqueue_ns(worker_tids_[w].load(std::memory_order_acquire)), any = true;
  if (!any) return;
  std::this_thread::sleep_for(std::chrono::microseconds(kPullProbeUs));
  for (int w = 0; w < num_threads(); ++w) {
    if (w == tid || !late(w)) continue;
    const pid_t thread = worker_tids_[w].load(std::memory_order_acquire);
    if (thread <= 0) continue;
    const int64_t now = runqueue_ns(thread);
    if (queued[w] >= 0 && now >= 0 && now - queued[w] < kPullProbeUs * 1000 / 2) continue;  // it runs
    // The flag before the second look at the laggard, the laggard its arrival before its look at
    // the flag (both sequentially consistent): either this sees it arrived and leaves it, or it
    // sees the flag and restores itself, under the lock, after this move. A check after the move
    // instead left a laggard that restored itself in between pinned to this core for good (both
    // workers of a 2-core pool on one core: decode 2x slower).
    std::lock_guard<std::mutex> lock(pull_locks_[w]);
    if (pulled_[w].load(std::memory_order_relaxed)) continue;  // another worker moved it
    pulled_[w].store(true, std::memory_order_seq_cst);
    if (!late(w) || sched_setaffinity(thread, sizeof(here), &here) != 0)
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

void WorkerContext::barrier() const {
  const uint64_t mine = runner->barriers_reached_[tid].fetch_add(1, std::memory_order_seq_cst) + 1;
  const std::function<void()> pull = [this, mine] {  // after SpinBarrier::kLongWaitUs
    runner->pull_laggards(
        tid, [&](int w) { return runner->barriers_reached_[w].load(std::memory_order_seq_cst) < mine; });
  };
  runner->all_barrier_.arrive_and_wait(&pull);
  runner->restore_if_pulled(tid);
}

void WorkerContext::pool_barrier() const {
  runner->pool_barriers_[pool]->arrive_and_wait();
}

int64_t Runner::pending() const {
  return static_cast<int64_t>(submitted_.load() - completed_.load());
}

void Runner::record_error(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!first_error_) first_error_ = error;
}

void Runner::worker_main(int tid) {
  // Any core of the pool, not one core per worker: a worker whose core another thread takes (on a GPU
  // host the CUDA callback thread, the Python thread spinning in synchronize) moves to a core whose
  // worker waits, instead of holding the step for a scheduler tick. Two cores with one busy process
  // beside the engine (bench/bench_contention.py, Qwen3 AMXINT4 at T=1): the median call went from
  // 7-8x to 1.7-1.9x the median alone, p90 from 7-9x to 1.9-2.4x (with the barrier's short spin,
  // thread_pool.cpp); pulling only after SpinBarrier::kLongWaitUs, 1.6x and 1.7x.
  bind_current_thread_to(pools_[contexts_[tid].pool].cpus);
  pthread_setname_np(pthread_self(), ("kt-worker-" + std::to_string(tid)).substr(0, 15).c_str());  // top -H
  worker_tids_[tid].store(static_cast<int>(gettid()), std::memory_order_release);
  for (;;) {
    const uint64_t step = step_.load(std::memory_order_acquire);
    const uint64_t kind = step & 3;
    if (kind == kIdle && stop_.load(std::memory_order_acquire)) return;
    int64_t unit = 0;
    if (kind == kEach) {
      // Until this worker runs it the step cannot close.
      if (each_done_[tid].load(std::memory_order_relaxed) != step) {
        run_unit(tid, step, tid);
        continue;
      }
    } else if (kind != kIdle && claim(tid, step, unit)) {
      run_unit(tid, step, unit);
      continue;
    }
    wait_for_step(tid, step);
  }
}

}  // namespace kt
