"""HF transformers models with their routed experts replaced by our hybrid layer stack.

The same engine, weights and semantics as the SGLang plugin serves (hot experts 0..hot-1, the
deferral chain), inside transformers' own forward: what the tests and the accuracy benchmark compare
the server against, and a way to run our engine under ``model.generate``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kt_sglang.engine.wrapper import KTMoEWrapper
from kt_sglang.layer.hybrid import DEFERRAL_MAX_TOKENS, DeferralChain, HybridMoELayer
from kt_sglang.placement import slot_map


class EngineExperts(torch.nn.Module):
    """Stands in for a transformers MoE block's ``experts``: (hidden, top-k ids, top-k weights) -> out."""

    def __init__(self, hybrid: HybridMoELayer) -> None:
        super().__init__()
        self.hybrid = hybrid

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.hybrid(hidden.bfloat16(), ids, weights.float()).to(hidden.dtype)


def replace_experts(
    model: torch.nn.Module,
    weight_path: str | Path,
    method: str = "BF16",
    hot: int = 0,
    deferred: int = 0,
    group_size: int | None = None,
    threads: int = 2,
    expert_lora_path: str | Path | None = None,
    deferral_max_tokens: int | None = DEFERRAL_MAX_TOKENS,
) -> list[HybridMoELayer]:
    """Swaps every MoE block's experts of a Qwen3-MoE or Mixtral ``model`` for our layers, in place.

    ``weight_path`` is the HF checkpoint (quantized at load for quantized methods) or a directory
    written by ``kt-sglang convert-cpu``; hot experts take the model's own bf16 weights.
    ``expert_lora_path`` (a PEFT adapter of the routed experts) is merged into the CPU experts before
    they are quantized, as ``--kt-expert-lora-path`` does; it needs ``hot=0``. ``deferral_max_tokens``:
    the largest batch that defers, as ``--kt-deferral-max-batch`` (None: every batch).
    """
    if expert_lora_path and hot:
        raise ValueError("replace_experts merges an expert adapter into the CPU experts only: use hot=0")
    cfg = model.config
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    intermediate = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    chain, hybrids = DeferralChain(), []
    on_gpu = slot_map(list(range(hot)), num_experts) >= 0  # the engine neither reads nor holds them
    for i, block in enumerate(model.model.layers):
        fused = block.mlp.experts
        experts = KTMoEWrapper(
            i, num_experts, cfg.num_experts_per_tok, cfg.hidden_size, intermediate, on_gpu, threads, 1,
            weight_path=str(weight_path), method=method, group_size=group_size,
            expert_lora_path=str(expert_lora_path) if expert_lora_path else None,
        )  # fmt: skip
        experts.load_weights()
        hybrid = HybridMoELayer(
            experts,
            slot_map(list(range(hot)), num_experts),
            fused.gate_up_proj.data[:hot].bfloat16(),
            fused.down_proj.data[:hot].bfloat16(),
            chain,
            deferred,
            deferral_max_tokens,
        )
        block.mlp.experts = EngineExperts(hybrid)
        hybrids.append(hybrid)
    HybridMoELayer.link(hybrids)
    return hybrids
