// One layer's forward bound to fixed host buffers, submitted and synced in CUDA stream order.
//
// submit(stream) and sync(stream) enqueue host functions: the first reads the batch size from
// `tokens` (pinned memory the stream wrote) and enqueues the forward on the runner; the second
// waits for it, holding the stream until the output buffer is ready. A captured CUDA graph replays
// both with this object as their data, so it must outlive every graph that captured it; nothing is
// allocated per call. A host function cannot throw: a failure is kept and raised by check().
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
  // args.tokens_ptr must be set; args.max_tokens bounds the batch size read at run time.
  StreamForward(MoeLayer& layer, std::shared_ptr<Runner> runner, const ForwardArgs& args);
  StreamForward(const StreamForward&) = delete;
  StreamForward& operator=(const StreamForward&) = delete;

  // On `stream` (a CUDA stream handle), or at once when there is none (CPU tensors).
  void submit(std::optional<uintptr_t> stream);
  void sync(std::optional<uintptr_t> stream);
  // Rethrows (once) the first failure of a host function run so far.
  void check();

 private:
  static void on_submit(void* self);
  static void on_sync(void* self);
  void keep(std::exception_ptr error);

  MoeLayer& layer_;
  std::shared_ptr<Runner> runner_;
  ForwardArgs args_;
  std::atomic<uint64_t> task_{0};  // 0: nothing submitted since the last sync
  std::mutex mutex_;
  std::exception_ptr error_;
};

}  // namespace kt
