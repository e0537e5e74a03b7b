// The worker pools and the asynchronous task runner.
//
// `threads` workers in total, grouped into pools (one per NUMA node, or several on one node), each
// pinned to a core. There is no extra dispatcher thread: worker 0 takes the next task from the
// queue and every worker runs it, so never more than `threads` threads are busy. Idle workers spin
// briefly, yielding the core now and then, then park on a futex. Callers of sync() sleep.
#pragma once

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kt {

struct PoolSpec {
  int node = 0;           // NUMA node (OS index) whose memory the pool uses
  std::vector<int> cpus;  // one worker per entry, pinned to that OS cpu
};

class SpinBarrier {
 public:
  explicit SpinBarrier(int count = 1) : count_(count) {}
  void reset(int count) { count_ = count; }
  // `on_long_wait`, if given, runs once when this worker has waited kLongWaitUs (asleep after a
  // short spin) and the others have not all arrived.
  void arrive_and_wait(const std::function<void()>* on_long_wait = nullptr);
  // Long enough that a worker merely behind (the caller's thread took its core for a few us, its
  // share was larger) is not pulled: pulled at once (~20 us), both workers of a 2-core pool shared
  // one core for the rest of the call, since the kernel keeps a task that just ran where it is
  // (one-token decode 1.6 against 0.8 ms when the caller spent 20 us between calls); short next to
  // the scheduler slice a preempted worker otherwise waits out (several ms).
  static constexpr int kLongWaitUs = 500;

 private:
  int count_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<int> sleepers_{0};  // waiters in the futex: the last arrival wakes them only if any
};

class Runner;

// What one worker sees while it runs a task.
struct WorkerContext {
  int tid;           // 0 .. threads-1
  int pool;          // 0 .. pools-1
  int rank_in_pool;  // 0 .. pool_size-1
  int pool_size;
  int num_threads;
  Runner* runner;
  void barrier() const;       // all workers
  void pool_barrier() const;  // the workers of this pool
};

// Every worker calls the task once; it returns when this worker's share is done. A task must reach
// its own barriers on every worker even when part of it fails: catch, record, go on.
using Task = std::function<void(const WorkerContext&)>;

class Runner {
 public:
  explicit Runner(std::vector<PoolSpec> pools);
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Enqueues a task and returns at once; tasks run in submission order. Returns its sequence number.
  uint64_t submit(Task task);
  // Waits until at most `allow_pending` of the tasks submitted before the call are queued or
  // running (tasks submitted meanwhile by other threads do not extend the wait), then rethrows the
  // first error any finished task recorded (once).
  void sync(int64_t allow_pending = 0);
  // Waits until task `id` (and so every task before it) finished; rethrows as sync() does.
  void wait(uint64_t id);
  // Waits as wait() does but leaves any error for sync()/wait() to report: for owners that must not
  // be freed while their tasks run (destructors).
  void wait_done(uint64_t id);
  // Submits and waits for this one task (and those before it).
  void run(Task task);
  int64_t pending() const;

  // Called by tasks to report a failure; the first one surfaces at sync().
  void record_error(std::exception_ptr error);

  int num_threads() const { return static_cast<int>(workers_.size()); }
  int num_pools() const { return static_cast<int>(pools_.size()); }
  const PoolSpec& pool(int p) const { return pools_[p]; }
  static int spin_microseconds();
  // How many times a worker waiting at the all-worker barrier moved a late one onto its core.
  uint64_t pulls() const { return pulls_.load(std::memory_order_relaxed); }

 private:
  friend struct WorkerContext;
  void worker_main(int tid, int pool, int rank);
  // A worker that has waited SpinBarrier::kLongWaitUs at the all-worker barrier moves the workers
  // that have not reached it onto its own core (their affinity, for this barrier only): a worker
  // preempted on a core another thread holds otherwise waits there for a scheduler slice (several
  // ms), since the kernel does not pull a task that ran within its migration-cost window onto an
  // idle core.
  void pull_laggards(int tid);
  void restore_if_pulled(int tid);

  std::vector<PoolSpec> pools_;
  std::vector<int> worker_cpus_;  // by tid
  std::vector<std::thread> workers_;
  // By tid: the thread's id (for sched_setaffinity), barriers it reached, whether another worker
  // moved it onto its core.
  std::unique_ptr<std::atomic<int>[]> worker_tids_;
  std::unique_ptr<std::atomic<uint64_t>[]> barriers_reached_;
  std::unique_ptr<std::atomic<bool>[]> pulled_;
  std::unique_ptr<std::mutex[]> pull_locks_;  // by tid: a move of the worker and its restore
  std::vector<cpu_set_t> pool_cpus_;          // by tid: the cores of its pool, its affinity
  std::atomic<uint64_t> pulls_{0};
  SpinBarrier all_barrier_;
  std::vector<std::unique_ptr<SpinBarrier>> pool_barriers_;

  mutable std::mutex mutex_;
  std::condition_variable queue_cv_;  // worker 0 waits for tasks
  std::condition_variable done_cv_;   // callers of sync() wait for completions
  std::deque<Task> queue_;
  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> completed_{0};
  // The fewest completions a sleeping caller waits for (none: UINT64_MAX). Callers are woken
  // only once it is reached: with 8 tasks queued, waking the caller at each one cost the workers
  // 6-8 us of idle a task on 2 cores (the caller took a worker's core only to sleep again).
  uint64_t wake_at_ = UINT64_MAX;
  void wait_for_completions(std::unique_lock<std::mutex>& lock, uint64_t target);
  // The CPU the last caller slept on. The worker pinned there (else worker 0) counts the task's
  // completion and wakes the callers: a wake-up from the caller's own CPU is local, one from another
  // CPU is an interrupt between CPUs (Zen 4 VM, 2 cores: a fully masked forward 15-17 us against
  // 29-37 us).
  std::atomic<int> waiter_cpu_{-1};
  int notifier_ = 0;  // the waking worker of the current task: written by worker 0 before it bumps epoch_
  std::exception_ptr first_error_;
  bool stopping_ = false;

  Task current_;  // written by worker 0 before it bumps epoch_
  alignas(64) std::atomic<uint64_t> epoch_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace kt
