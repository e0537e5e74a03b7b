// Fine-tuning mode: LoRA adapters on a MoE layer's CPU experts, forward and backward, over the
// layer's packed (frozen) weights in any method.
//
// Per expert and projection, y = W x + s * B (A x) with s = alpha / rank. The forward keeps what
// the backward needs (SftSaved); the backward gives the gradient to the hidden states, to the
// routing weights, and adds the adapters' gradients to caller-owned tensors.
//
// The backward's products with the frozen weights are transposed (dx = dg W, with W [N, K] packed
// as panels of 16 rows of N): each work item decodes a 64-column block W[:, k0:k0 + 64] of the
// packed panels into bf16 panels of W^T (BF16's packed layout, reduction over N) in per-thread
// scratch and runs the ISA's BF16 GEMM on it. No second copy of the weights is kept.
#pragma once

#include <cstdint>
#include <memory>

#include "kt/moe_layer.h"

namespace kt {

// The six adapters of every expert, in kt-kernel's order and shapes (E experts, rank r):
//   gate_a, up_a [E, r, H]; gate_b, up_b [E, I, r]; down_a [E, r, I]; down_b [E, H, r].
enum LoraTensor : int { kGateA = 0, kGateB, kUpA, kUpB, kDownA, kDownB, kNumLoraTensors };

struct LoraConfig {
  int rank = 16;
  float alpha = 32.0f;
  // The backward computes the input and routing-weight gradients through the frozen weights only:
  // no adapter gradients and no adapter terms in the input gradient (kt-kernel's *_SkipLoRA).
  bool skip_lora = false;
};

// The adapters and their gradients, contiguous, all of one dtype (fp32 or bf16). The backward adds
// to the gradients, as torch accumulates .grad.
struct LoraTensors {
  DType dtype = DType::kFloat32;
  const void* weight[kNumLoraTensors] = {};
  void* grad[kNumLoraTensors] = {};
};

struct SftForwardArgs {
  int64_t tokens = 0;
  const uint16_t* hidden = nullptr;  // bf16 [tokens, hidden]
  const void* expert_ids = nullptr;  // int32 or int64 [tokens, top_k]; -1 = skip
  bool ids_int64 = false;
  const float* weights = nullptr;   // fp32 [tokens, top_k]
  const bool* skip_mask = nullptr;  // [num_experts], true = not computed here; may be null
  uint16_t* out = nullptr;          // bf16 [tokens, hidden]
};

struct SftBackwardArgs {
  const uint16_t* grad_out = nullptr;  // bf16 [tokens, hidden]
  float* grad_in = nullptr;            // fp32 [tokens, hidden], written
  float* grad_weights = nullptr;       // fp32 [tokens, top_k], written (0 where nothing was computed)
};

// What one forward keeps for its backward (src/lora_tasks.h). Owned by the caller; freed with it.
struct SftSaved;
std::shared_ptr<SftSaved> make_sft_saved();
int64_t sft_saved_bytes(const SftSaved& saved);
int64_t sft_saved_tokens(const SftSaved& saved);

class SftMoe {
 public:
  // The layer must outlive this object, use the plain SiLU activation and have no biases.
  SftMoe(MoeLayer& layer, const LoraConfig& config);
  ~SftMoe();
  SftMoe(const SftMoe&) = delete;
  SftMoe& operator=(const SftMoe&) = delete;

  const LoraConfig& config() const { return config_; }
  // Pointers are kept: the tensors must stay alive and in place while tasks may read them. Without
  // adapters the forward is the frozen layer's.
  void set_lora(const LoraTensors& tensors);

  // Enqueue on the layer's runner and return the task id. `save` may be null (nothing kept).
  uint64_t submit_forward(const SftForwardArgs& args, std::shared_ptr<SftSaved> save);
  // `saved` must hold a finished forward of this layer (the runner runs tasks in order, so one
  // submitted before this call counts).
  uint64_t submit_backward(std::shared_ptr<SftSaved> saved, const SftBackwardArgs& args);
  void drain() const;

  struct Scratch;

 private:
  MoeLayer& layer_;
  LoraConfig config_;
  LoraTensors lora_;
  bool has_lora_ = false;
  std::unique_ptr<Scratch> scratch_;
  std::shared_ptr<SftSaved> unsaved_;  // the state of forwards that keep nothing
  uint64_t last_task_ = 0;
};

}  // namespace kt
