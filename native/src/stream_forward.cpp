#include "kt/stream_forward.h"

#include <cstdint>
#include <stdexcept>
#include <utility>

#include "kt/cuda_host.h"

namespace kt {

StreamForward::StreamForward(MoeLayer& layer, std::shared_ptr<Runner> runner, const ForwardArgs& args)
    : layer_(layer), runner_(std::move(runner)), args_(args) {
  if (!args_.tokens_ptr)
    throw std::invalid_argument("StreamForward needs the batch size pointer (tokens_ptr)");
  if (args_.max_tokens < 1)
    throw std::invalid_argument("StreamForward needs the buffers' capacity (max_tokens)");
}

void StreamForward::submit(std::optional<uintptr_t> stream) {
  check();
  if (stream)
    launch_host_func(*stream, &StreamForward::on_submit, this);
  else
    on_submit(this);
  check();  // run at once (no stream, or no driver): its error is known now
}

void StreamForward::sync(std::optional<uintptr_t> stream) {
  if (stream)
    launch_host_func(*stream, &StreamForward::on_sync, this);
  else
    on_sync(this);
  check();
}

void StreamForward::check() {
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
