// One layer's forward bound to fixed host buffers, submitted and synced in CUDA stream order.
//
// Two ways, chosen once per process (kt/cuda_host.h, stream_signal()):
// - memory operations: submit(stream) enqueues a write of 1 into the `ready` word of pinned host
//   memory, sync(stream) a wait until the `done` word is 1 and a write of 0 into it. The engine's
//   signal thread (one per process) sees `ready`, clears it and enqueues the forward, whose last
//   step sets `done`. No host thread holds a stream, so a deferred task's submit never waits behind
//   another task's sync; the values are constants, so a captured CUDA graph replays them as they are.
// - host functions: submit(stream) and sync(stream) enqueue host functions: the first reads the
//   batch size and enqueues the forward on the runner; the second waits for it, holding the stream
//   (and the driver's one callback thread) until the output buffer is ready.
// Either way the forward reads the batch size from `tokens` (pinned memory the stream wrote) when
// it runs. A captured graph refers to this object's words or to this object itself, so it must
// outlive every graph that captured it; nothing is allocated per call. Failures on the signal
// thread or in a host function are kept and raised by check().
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>

#include "kt/moe_layer.h"

namespace kt {

class StreamForward {
 public:
  // The signal words: kSignalWords uint32 of pinned host memory, `ready` and `done` on cache lines
  // of their own (the stream writes one while the engine reads the other).
  static constexpr int kSignalWords = 32;
  static constexpr int kReady = 0;
  static constexpr int kDone = 16;

  // args.tokens_ptr must be set; args.max_tokens bounds the batch size read at run time.
  // signal_words: kSignalWords words, zeroed, or null (host functions only).
  StreamForward(MoeLayer& layer, std::shared_ptr<Runner> runner, const ForwardArgs& args,
                uint32_t* signal_words);
  ~StreamForward();
  StreamForward(const StreamForward&) = delete;
  StreamForward& operator=(const StreamForward&) = delete;

  // On `stream` (a CUDA stream handle), or at once when there is none (CPU tensors).
  void submit(std::optional<uintptr_t> stream);
  void sync(std::optional<uintptr_t> stream);
  // Rethrows (once) the first failure kept so far.
  void check();

  // The signal thread watches this object's words from now on (submit does it on a memory-ops
  // stream; a caller that plays the stream's part itself, as the tests do, calls it directly).
  void arm();
  // Forwards the signal thread has run for this object.
  uint64_t signalled_forwards() const { return signalled_.load(std::memory_order_acquire); }

  // Signal thread: collects a finished forward, starts one whose `ready` is set. True when it did
  // either; `busy` is set while a forward runs.
  bool poll(bool& busy);

 private:
  static void on_submit(void* self);
  static void on_sync(void* self);
  void keep(std::exception_ptr error);
  // Takes finished signal task `task` (its error, its count) unless another thread did; true if so.
  bool collect(uint64_t task);

  MoeLayer& layer_;
  std::shared_ptr<Runner> runner_;
  ForwardArgs args_;
  ForwardArgs signal_args_;  // args_ with done_flag: the signal thread's forwards
  uint32_t* words_;
  uint64_t device_words_ = 0;             // the words' device address (memory-ops streams)
  std::atomic<uint64_t> task_{0};         // host functions: 0 when nothing was submitted since the last sync
  std::atomic<uint64_t> signal_task_{0};  // the signal thread's forward running, 0 when none
  std::atomic<uint64_t> signalled_{0};
  std::atomic<bool> armed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

// The signal thread's mode and state, for doctor and tests: armed objects, forwards run.
struct SignalThreadStats {
  int64_t armed = 0;
  uint64_t forwards = 0;
};
SignalThreadStats signal_thread_stats();

}  // namespace kt
