#include "kt/stream_forward.h"

#include <immintrin.h>
#include <sched.h>
#include <sys/prctl.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "kt/cuda_host.h"

namespace kt {

namespace {

// One thread per process watches the `ready` words of every armed StreamForward and starts their
// forwards. It spins while words change often (a decode step hands a layer over every few tens of
// microseconds), yields the core when others want it, and sleeps longer the longer nothing comes.
class SignalThread {
 public:
  static SignalThread& instance() {
    static SignalThread* thread = new SignalThread;  // never destroyed: objects may outlive statics
    return *thread;
  }

  void add(StreamForward* f) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { main(); });
    armed_.push_back(f);
    cv_.notify_one();
  }

  // After it returns the thread no longer touches `f`.
  void remove(StreamForward* f) {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_.erase(std::remove(armed_.begin(), armed_.end(), f), armed_.end());
  }

  SignalThreadStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    SignalThreadStats s;
    s.armed = static_cast<int64_t>(armed_.size());
    for (const StreamForward* f : armed_) s.forwards += f->signalled_forwards();
    return s;
  }

 private:
  // How long after the last handover the thread pauses in place, yields its core, then sleeps.
  static constexpr auto kSpin = std::chrono::microseconds(200);  // with no forward running
  static constexpr auto kYield = std::chrono::milliseconds(5);
  static constexpr auto kShortSleeps = std::chrono::milliseconds(100);
  static constexpr long kShortSleepNs = 20'000, kLongSleepNs = 1'000'000;

  void main() {
    prctl(PR_SET_TIMERSLACK, 1UL);  // a 20 us sleep, not the default 50 us of slack on top
    using Clock = std::chrono::steady_clock;
    auto last = Clock::now();
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (armed_.empty()) {
        cv_.wait(lock, [this] { return !armed_.empty(); });
        last = Clock::now();
      }
      bool busy = false, progress = false;
      for (StreamForward* f : armed_) progress |= f->poll(busy);
      lock.unlock();
      const auto now = Clock::now();
      if (progress) last = now;
      const auto idle = now - last;
      if (progress) {
      } else if (idle < kSpin && !busy) {
        for (int i = 0; i < 16; ++i) _mm_pause();
      } else if (idle < kYield) {  // a forward running wants the cores more than we do
        sched_yield();
      } else {
        const timespec nap{0, idle < kShortSleeps ? kShortSleepNs : kLongSleepNs};
        nanosleep(&nap, nullptr);
      }
      lock.lock();
    }
  }

  std::mutex mutex_;  // armed_, and held while the thread polls them
  std::condition_variable cv_;
  std::vector<StreamForward*> armed_;
  std::thread thread_;
};

}  // namespace

SignalThreadStats signal_thread_stats() {
  return SignalThread::instance().stats();
}

StreamForward::StreamForward(MoeLayer& layer, std::shared_ptr<Runner> runner, const ForwardArgs& args,
                             uint32_t* signal_words)
    : layer_(layer), runner_(std::move(runner)), args_(args), signal_args_(args), words_(signal_words) {
  if (!args_.tokens_ptr)
    throw std::invalid_argument("StreamForward needs the batch size pointer (tokens_ptr)");
  if (args_.max_tokens < 1)
    throw std::invalid_argument("StreamForward needs the buffers' capacity (max_tokens)");
  if (words_) signal_args_.done_flag = &words_[kDone];
}

StreamForward::~StreamForward() {
  if (armed_.load()) SignalThread::instance().remove(this);
  if (const uint64_t task = signal_task_.load(); task != 0) runner_->wait_done(task);
}

void StreamForward::arm() {
  if (!words_) throw std::logic_error("StreamForward::arm: made without signal words");
  if (!armed_.exchange(true)) SignalThread::instance().add(this);
}

void StreamForward::submit(std::optional<uintptr_t> stream) {
  check();
  if (stream && words_ && stream_signal() == StreamSignal::kMemoryOps) {
    if (device_words_ == 0) device_words_ = host_device_pointer(words_);
    arm();
    stream_write_value32(*stream, device_words_ + kReady * sizeof(uint32_t), 1);
    return;
  }
  if (stream)
    launch_host_func(*stream, &StreamForward::on_submit, this);
  else
    on_submit(this);
  check();  // run at once (no stream, or no driver): its error is known now
}

void StreamForward::sync(std::optional<uintptr_t> stream) {
  if (stream && words_ && stream_signal() == StreamSignal::kMemoryOps) {
    const uint64_t done = device_words_ + kDone * sizeof(uint32_t);
    stream_wait_value32(*stream, done, 1);
    stream_write_value32(*stream, done, 0);  // the next forward's wait starts from 0
    check();
    return;
  }
  if (stream)
    launch_host_func(*stream, &StreamForward::on_sync, this);
  else
    on_sync(this);
  check();
}

bool StreamForward::collect(uint64_t task) {
  if (!signal_task_.compare_exchange_strong(task, 0, std::memory_order_acq_rel)) return false;
  try {
    runner_->wait(task);  // finished: takes its error, if any
  } catch (...) {
    keep(std::current_exception());
  }
  signalled_.fetch_add(1, std::memory_order_release);
  return true;
}

bool StreamForward::poll(bool& busy) {
  bool progress = false;
  if (const uint64_t task = signal_task_.load(std::memory_order_acquire); task != 0) {
    if (!runner_->finished(task)) {
      busy = true;
      return false;
    }
    progress = collect(task);  // or check() did
  }
  std::atomic_ref<uint32_t> ready(words_[kReady]);
  if (ready.load(std::memory_order_acquire) != 1) return progress;
  ready.store(0, std::memory_order_relaxed);  // before the forward: one wake-up, one forward
  try {
    signal_task_.store(layer_.submit_forward(signal_args_), std::memory_order_release);
    busy = true;
  } catch (...) {
    keep(std::current_exception());
    signalled_.fetch_add(1, std::memory_order_release);
    // The stream waits for this word: it must come, output or not (check() reports why).
    std::atomic_ref<uint32_t>(words_[kDone]).store(1, std::memory_order_release);
  }
  return true;
}

void StreamForward::check() {
  // A forward that set `done` has finished: its error is taken here if the signal thread has not yet.
  if (const uint64_t task = signal_task_.load(std::memory_order_acquire);
      task != 0 && runner_->finished(task))
    collect(task);
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

void StreamForward::keep(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) error_ = error;
}

void StreamForward::on_submit(void* data) {
  auto* self = static_cast<StreamForward*>(data);
  try {
    if (self->task_.load() != 0) throw std::logic_error("submit on a stream twice without a sync in between");
    self->task_.store(self->layer_.submit_forward(self->args_));
  } catch (...) {
    self->keep(std::current_exception());
  }
}

void StreamForward::on_sync(void* data) {
  auto* self = static_cast<StreamForward*>(data);
  const uint64_t task = self->task_.exchange(0);
  if (task == 0) return;  // the submit failed and kept its error
  try {
    self->runner_->wait(task);
  } catch (...) {
    self->keep(std::current_exception());
  }
}

}  // namespace kt
