// The fine-tuning layer (kt/lora.h): validation, the adapters' tensors, and the forward (the layer's
// forward plan with the adapters' client, lora_forward.cpp) and backward (lora_backward.cpp) tasks
// over the layer's packed weights, its kernel table and its routing (routing.h).
#include "kt/lora.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "forward/forward.h"
#include "kt/float_types.h"
#include "kt/thread_scratch.h"
#include "lora_tasks.h"

namespace kt {

namespace sft {

Shape shape_of(const MoeLayer& layer, const LoraConfig& lora) {
  const MoeConfig& c = layer.config();
  Shape d{c.num_experts,
          c.top_k,
          layer.num_pools(),
          layer.group(),
          lora.rank,
          c.hidden,
          c.intermediate,
          layer.hidden_padded(),
          layer.intermediate_padded(),
          round_up(c.hidden, kPanelWidth),
          layer.gate_up_block(),
          lora.alpha / static_cast<float>(lora.rank),
          0};
  while (d.lora_pool + 1 < d.P &&
         layer.packed_slice(d.lora_pool).i_end == layer.packed_slice(d.lora_pool).i_begin)
    ++d.lora_pool;
  return d;
}

WorkerScratch& worker_scratch() {
  auto& sc = *thread_scratch<WorkerScratch>();
  grow(sc.ptrs, kMaxCallRows);
  return sc;
}

void load_f32(const void* src, DType dtype, int64_t offset, int64_t rows, int64_t cols, int64_t ld,
              bool transpose, float* dst, int64_t ld_dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t at = offset + r * ld + c;
      const float v = dtype == DType::kFloat32 ? static_cast<const float*>(src)[at]
                                               : bf16_to_float(static_cast<const uint16_t*>(src)[at]);
      dst[transpose ? c * ld_dst + r : r * ld_dst + c] = v;
    }
}

void add_into(void* dst, DType dtype, int64_t offset, const float* src, int64_t n, int64_t cols) {
  const int64_t rows = cols > 0 ? n / cols : 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = cols > 0 ? src[(i % cols) * rows + i / cols] : src[i];
    if (dtype == DType::kFloat32) {
      static_cast<float*>(dst)[offset + i] += v;
    } else {
      uint16_t& d = static_cast<uint16_t*>(dst)[offset + i];
      d = float_to_bf16(bf16_to_float(d) + v);
    }
  }
}

}  // namespace sft

std::shared_ptr<SftSaved> make_sft_saved() {
  return std::make_shared<SftSaved>();
}

int64_t sft_saved_bytes(const SftSaved& s) {
  // Per row its token, expert and weight; per slot its row.
  return static_cast<int64_t>(s.x.size() * 2 + (s.xa.size() + s.g.size() + s.u.size() + s.ha.size()) * 4 +
                              s.h.size() * 2) +
         s.tokens * s.top_k * 8 + s.rows * 12;
}

int64_t sft_saved_tokens(const SftSaved& s) {
  return s.tokens;
}

SftMoe::SftMoe(MoeLayer& layer, const LoraConfig& config)
    : layer_(layer), config_(config), scratch_(std::make_unique<Scratch>()), unsaved_(make_sft_saved()) {
  const MoeConfig& c = layer.config();
  if (!c.glu.plain())
    throw std::invalid_argument("fine-tuning supports the SiLU-gated experts (silu(gate) * up) only");
  if (layer.has_biases()) throw std::invalid_argument("fine-tuning supports experts without biases only");
  if (!layer.one_method())
    throw std::invalid_argument("fine-tuning reads gate/up and down with one method; this layer has two");
  if (!layer.holds_every_expert())
    throw std::invalid_argument(
        "fine-tuning trains every expert on the CPU: build the layer without absent experts");
  if (config.rank < 1 || config.rank > std::min(c.hidden, c.intermediate))
    throw std::invalid_argument("lora_rank " + std::to_string(config.rank) + " must be in 1.." +
                                std::to_string(std::min(c.hidden, c.intermediate)) +
                                " (the smaller of hidden_size and moe_intermediate_size)");
  if (!std::isfinite(config.alpha)) throw std::invalid_argument("lora_alpha must be finite");
}

SftMoe::~SftMoe() {
  drain();
}

void SftMoe::drain() const {
  layer_.runner().wait_done(last_task_);
}

void SftMoe::set_lora(const LoraTensors& tensors) {
  if (tensors.dtype != DType::kFloat32 && tensors.dtype != DType::kBFloat16)
    throw std::invalid_argument("LoRA tensors must be float32 or bfloat16");
  for (int i = 0; i < kNumLoraTensors; ++i)
    if (!tensors.weight[i] || !tensors.grad[i])
      throw std::invalid_argument("every LoRA tensor and gradient is needed");
  drain();  // a pending task reads the old pointers
  lora_ = tensors;
  has_lora_ = true;
}

uint64_t SftMoe::submit_forward(const SftForwardArgs& args, std::shared_ptr<SftSaved> save) {
  if (!layer_.loaded()) throw std::runtime_error("load the layer's weights before a forward");
  if (args.tokens < 1) throw std::invalid_argument("a forward needs at least one token");
  const MoeConfig& c = layer_.config();
  check_expert_ids(args.expert_ids, args.ids_int64, args.tokens, c.top_k, c.num_experts);
  std::shared_ptr<SftSaved> saved = save ? std::move(save) : unsaved_;
  saved->owner = this;
  ForwardArgs forward;
  forward.tokens = args.tokens, forward.hidden = args.hidden, forward.expert_ids = args.expert_ids;
  forward.ids_int64 = args.ids_int64, forward.weights = args.weights, forward.skip_mask = args.skip_mask;
  forward.out = args.out;
  auto lora = std::make_shared<sft::ForwardLora>(layer_, lora_, has_lora_, sft::shape_of(layer_, config_),
                                                 args.hidden, std::move(saved));
  last_task_ = layer_.runner().submit(std::make_shared<ForwardTask>(layer_, forward, std::move(lora)));
  return last_task_;
}

uint64_t SftMoe::submit_backward(std::shared_ptr<SftSaved> saved, const SftBackwardArgs& args) {
  if (!saved || saved->owner != this)
    throw std::invalid_argument("backward needs the state saved by a forward of this layer");
  const bool lora = has_lora_ && !config_.skip_lora;
  last_task_ = layer_.runner().submit(std::make_shared<sft::BackwardTask>(
      layer_, lora_, lora, sft::shape_of(layer_, config_), *scratch_, args, std::move(saved)));
  return last_task_;
}

}  // namespace kt
