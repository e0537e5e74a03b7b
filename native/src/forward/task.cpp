// The forward task's steps in order and their shapes (forward.h).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>

#include "forward/forward.h"
#include "kt/quantize.h"

namespace kt {

ForwardTask::ForwardTask(const MoeLayer& layer, const ForwardArgs& args,
                         std::shared_ptr<ForwardClient> client)
    : layer_(layer),
      ws_(layer.workspace()),
      table_(layer.kernels()),
      biases_(layer.biases()),
      args_(args),
      client_(std::move(client)) {
  const MoeConfig& c = layer.config();
  const Method down = *c.down_method;
  chunk_ = {0,
            0,
            client_ ? std::numeric_limits<int64_t>::max() : c.max_chunk_tokens,
            c.num_experts,
            c.top_k,
            layer.num_pools(),
            layer.group(),
            c.down_group,
            c.hidden,
            layer.hidden_padded(),
            round_up(c.hidden, kPanelWidth),
            layer.gate_up_block(),
            !client_ && method_traits(c.method).gate_up_input == Activation::kInt8,
            !client_ && (method_traits(down).down_input == Activation::kInt8 ||
                         (c.int8_input_per_row && table_.method(down).gemm_q8)),
            table_.method(c.method).gemm_q8,
            table_.method(down).gemm_q8,
            table_.method(c.method).gemm_a16,
            table_.method(down).gemm_a16};
  plan_.pools.resize(chunk_.P);
}

bool ForwardTask::next_step(StepShape& shape) {
  if (advance(shape)) return true;
  // The stream waiting on this word reads the output next (the task's end, failed or not).
  if (args_.done_flag) std::atomic_ref<uint32_t>(*args_.done_flag).store(1, std::memory_order_release);
  return false;
}

void ForwardTask::run_unit(int64_t unit, const WorkerContext& ctx) {
  switch (step_) {
    case Step::kStart:
      started_ = start();
      break;
    case Step::kRoute:
      route();
      break;
    case Step::kGather:
      gather_unit(unit);
      break;
    case Step::kExperts:
      experts_unit(unit, ctx);
      break;
    case Step::kCombine:
      combine_item(unit);
      break;
    case Step::kNone:
      break;
  }
}

bool ForwardTask::advance(StepShape& shape) {
  auto any = [&](int64_t units) {
    shape.kind = StepShape::Kind::kAnyWorker;
    shape.units = units;
    return true;
  };
  if (step_ == Step::kNone) {
    step_ = Step::kStart;
    return any(1);
  }
  if (step_ == Step::kStart && !started_) return false;
  if (step_ == Step::kStart || step_ == Step::kRoute) {
    if (ws_.bad_routing) return false;
    plan_steps();
    step_ = Step::kGather;
    return any(plan_.token_units + plan_.client_units);
  }
  if (ws_.failed.load(std::memory_order_acquire)) return false;
  switch (step_) {
    case Step::kGather:
      step_ = Step::kExperts;
      shape.kind = StepShape::Kind::kPerPool;
      for (int p = 0; p < chunk_.P; ++p) shape.pool_units[p] = plan_.pools[p].experts_units;
      return true;
    case Step::kExperts:
      step_ = Step::kCombine;
      return any(plan_.combine_units);
    case Step::kCombine:  // the next chunk
      if (chunk_.c0 + chunk_.Tc >= ws_.tokens) return false;
      chunk_.c0 += chunk_.Tc;
      chunk_.Tc = std::min(chunk_.max_tokens, ws_.tokens - chunk_.c0);
      step_ = Step::kRoute;
      return any(1);
    default:
      return false;
  }
}

}  // namespace kt
