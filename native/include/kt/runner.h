// The worker pools and the asynchronous task runner.
//
// `threads` workers in total, grouped into pools (one per NUMA node, or several on one node), each
// bound to its pool's cores. There is no dispatcher thread: a task runs as a sequence of steps, and
// the worker that completes a step's last unit opens the next step (or the next task) itself.
// Units are claimed by whichever workers are free, so nobody waits for a worker that holds no unit:
// one descheduled between units, or not yet woken, delays nothing. Idle workers spin briefly,
// yielding the core now and then, then park on a futex. Callers of sync() sleep.
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
  void barrier() const;       // all workers (tasks submitted as a Task only)
  void pool_barrier() const;  // the workers of this pool (the same)
};

// Every worker calls the task once; it returns when this worker's share is done. A task must reach
// its own barriers on every worker even when part of it fails: catch, record, go on.
using Task = std::function<void(const WorkerContext&)>;

// The shape of a StepTask's next step.
struct StepShape {
  enum class Kind {
    kAnyWorker,  // `units` units, for any worker
    kPerPool,    // pool_units[p] units for the workers of pool p (their memory is on its node)
    kEachWorker  // one unit per worker, unit = ctx.tid: every worker runs it (barriers allowed)
  };
  Kind kind = Kind::kAnyWorker;
  int64_t units = 0;
  std::vector<int64_t> pool_units;  // sized to the pools by the runner
};

// A task run step by step by whichever workers are free. The units of a step run in any order on
// any eligible worker; a step opens once every unit of the previous one has returned.
class StepTask {
 public:
  virtual ~StepTask() = default;
  // Sets the next step's shape, or returns false when the task is done. Called with no unit of
  // the task running: by the worker that completed the previous step's last unit, the first time
  // by the thread that starts the task. Keep it short: the units do the work. A step of no units
  // is skipped.
  virtual bool next_step(StepShape& shape) = 0;
  // Unit `unit` of the open step (kPerPool: of ctx.pool's units). An exception is recorded for
  // sync() and counts the unit done.
  virtual void run_unit(int64_t unit, const WorkerContext& ctx) = 0;
};

class Runner {
 public:
  // Units a step may have (a cursor's field).
  static constexpr int64_t kMaxUnits = (int64_t{1} << 20) - 1;

  explicit Runner(std::vector<PoolSpec> pools);
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Enqueues a task and returns at once; tasks run in submission order. Returns its sequence number.
  uint64_t submit(Task task);
  uint64_t submit(std::shared_ptr<StepTask> task);
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
  // Whether task `id` (and so every task before it) finished; never blocks.
  bool finished(uint64_t id) const { return completed_.load(std::memory_order_acquire) >= id; }

  // Called by tasks to report a failure; the first one surfaces at sync().
  void record_error(std::exception_ptr error);

  int num_threads() const { return static_cast<int>(workers_.size()); }
  int num_pools() const { return static_cast<int>(pools_.size()); }
  const PoolSpec& pool(int p) const { return pools_[p]; }
  static int spin_microseconds();
  // How many times a waiting worker moved a late one onto its core.
  uint64_t pulls() const { return pulls_.load(std::memory_order_relaxed); }

 private:
  friend struct WorkerContext;
  struct alignas(64) Cursor {
    // The step's sequence number (low 24 bits), its units and the next unit (20 bits each): a
    // claim is a compare-and-swap that fails once the step changed.
    std::atomic<uint64_t> word{0};
  };
  enum StepKind : uint64_t { kIdle = 0, kAny = 1, kPool = 2, kEach = 3 };

  void worker_main(int tid);
  // Runs tasks from the queue until one has a step to open, or the queue is empty (idle). Called
  // by the completer of a task's last step, or by submit() when the runner was idle.
  void advance();
  void open_step();  // shape_ of current_ published
  void finish_task();
  void publish(uint64_t step);
  bool claim(int tid, uint64_t step, int64_t& unit);
  bool units_left(int pool, uint64_t step) const;  // pool's units of kPool step `step` not all taken
  void run_unit(int tid, uint64_t step, int64_t unit);
  // Waits for the step word to move from `step`; once it has waited SpinBarrier::kLongWaitUs on
  // an open step, pulls the workers it waits for onto this core: those holding its units (in an
  // each-worker step, not done with theirs), and those of a pool whose units are not all taken.
  void wait_for_step(int tid, uint64_t step);
  // A worker that has waited SpinBarrier::kLongWaitUs moves the workers `late` names onto its own
  // core (their affinity, until they arrive): a worker preempted on a core another thread holds
  // otherwise waits there for a scheduler slice (several ms), since the kernel does not pull a task
  // that ran within its migration-cost window onto an idle core.
  template <class Late>
  void pull_laggards(int tid, Late&& late);
  static constexpr int kPullProbeUs = 100;  // how long pull_laggards watches a laggard's run queue time
  void restore_if_pulled(int tid);

  std::vector<PoolSpec> pools_;
  std::vector<WorkerContext> contexts_;  // by tid
  std::vector<std::thread> workers_;
  // By tid: the thread's id (for sched_setaffinity), barriers it reached, the step (word) whose
  // unit it runs (0: none), the serial of the last each-worker step it ran, whether another worker
  // moved it onto its core.
  std::unique_ptr<std::atomic<int>[]> worker_tids_;
  std::unique_ptr<std::atomic<uint64_t>[]> barriers_reached_;
  std::unique_ptr<std::atomic<uint64_t>[]> in_step_;
  std::unique_ptr<std::atomic<uint64_t>[]> each_done_;
  std::unique_ptr<std::atomic<bool>[]> pulled_;
  std::unique_ptr<std::mutex[]> pull_locks_;  // by tid: a move of the worker and its restore
  std::vector<cpu_set_t> pool_cpus_;          // by tid: the cores of its pool, its affinity
  std::atomic<uint64_t> pulls_{0};
  SpinBarrier all_barrier_;
  std::vector<std::unique_ptr<SpinBarrier>> pool_barriers_;

  // The open step: written by whoever opens it (no unit of the task runs then), read by the
  // units. step_ (serial number << 2 | StepKind) is stored last, then its low half in step_futex_,
  // the word idle workers sleep on.
  alignas(64) std::atomic<uint64_t> step_{kIdle};
  std::atomic<uint32_t> step_futex_{kIdle};
  std::atomic<int> step_sleepers_{0};
  std::unique_ptr<Cursor[]> cursors_;  // by pool, then one for kAnyWorker steps
  alignas(64) std::atomic<int64_t> step_done_{0};
  int64_t step_units_ = 0;
  StepTask* current_ = nullptr;
  std::shared_ptr<StepTask> owned_;  // current_'s owner
  StepShape shape_;

  mutable std::mutex mutex_;
  std::condition_variable done_cv_;  // callers of sync() wait for completions
  std::deque<std::shared_ptr<StepTask>> queue_;
  bool running_ = false;  // a task is open (under mutex_)
  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> completed_{0};
  // The fewest completions a sleeping caller waits for (none: UINT64_MAX). Callers are woken
  // only once it is reached: with 8 tasks queued, waking the caller at each one cost the workers
  // 6-8 us of idle a task on 2 cores (the caller took a worker's core only to sleep again).
  uint64_t wake_at_ = UINT64_MAX;
  void wait_for_completions(std::unique_lock<std::mutex>& lock, uint64_t target);
  std::exception_ptr first_error_;
  bool stopping_ = false;
  std::atomic<bool> stop_{false};
};

}  // namespace kt
