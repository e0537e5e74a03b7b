"""Fine-tuning a transformers MoE model with LoRA on its routed experts in the CPU engine.

``attach_lora_experts(model)`` swaps each fused experts module (``...mlp.experts`` with
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``: Qwen3-MoE, Mixtral, DeepSeek-V3 and the
other transformers 5 MoE families) for a :class:`LoRAExperts` holding the same frozen weights, freezes
the rest of the model (attention, norms, shared experts, embeddings: add your own LoRA to them if you
like) and returns the new modules. An ordinary loop (``loss.backward()``, ``torch.optim.AdamW`` over
the returned modules' parameters) trains the adapters; ``save_expert_adapter`` writes them as a PEFT
adapter directory.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kt_sglang.finetune.adapter import ExpertAdapter, ExpertLoRA, save_adapter
from kt_sglang.finetune.experts import LoRAExperts


def _fused_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        name: m
        for name, m in model.named_modules()
        if name.endswith("experts")
        and isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)
        and isinstance(getattr(m, "down_proj", None), torch.nn.Parameter)
    }


def attach_lora_experts(
    model: torch.nn.Module,
    *,
    method: str = "BF16",
    rank: int = 16,
    alpha: float = 32.0,
    threads: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    train_router: bool = False,
) -> dict[str, LoRAExperts]:
    """Replaces every fused experts module of ``model`` in place; returns the new modules by path.
    With ``train_router`` the routers (``...mlp.gate``) train too, through the routing weights'
    gradient."""
    found = _fused_experts(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no fused MoE experts (a module '...experts' with gate_up_proj and "
            "down_proj parameters, as transformers 5 builds Qwen3-MoE, Mixtral and DeepSeek-V3)"
        )
    top_k = model.config.num_experts_per_tok
    for p in model.parameters():
        p.requires_grad_(False)
    replaced = {}
    for name, experts in found.items():
        m = re.search(r"layers\.(\d+)\.", name)
        layer_idx = int(m.group(1)) if m else 0
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        E, I2, H = gate_up.shape
        I = I2 // 2
        module = LoRAExperts(
            E, top_k, H, I, method=method, rank=rank, alpha=alpha, threads=threads,
            weights=(gate_up[:, :I], gate_up[:, I:], down), dtype=dtype, layer_idx=layer_idx,
            seed=seed + layer_idx,
        )  # fmt: skip
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, module)
        replaced[name] = module
        if train_router:
            mlp = model.get_submodule(parent_name)
            for p in getattr(mlp, "gate", torch.nn.Module()).parameters():
                p.requires_grad_(True)
    return replaced


def expert_lora(modules: dict[str, LoRAExperts]) -> dict[str, ExpertLoRA]:
    return {
        name: ExpertLoRA(*m.adapters, scale=m.wrapper.lora_alpha / m.wrapper.lora_rank)
        for name, m in modules.items()
    }


def save_expert_adapter(
    modules: dict[str, LoRAExperts], out: str | Path, base_model: str | None = None
) -> Path:
    """The adapters of ``attach_lora_experts``' modules as a PEFT adapter directory."""
    first = next(iter(modules.values())).wrapper
    return save_adapter(expert_lora(modules), out, first.lora_rank, first.lora_alpha, base_model)


def load_expert_adapter(modules: dict[str, LoRAExperts], path: str | Path) -> None:
    """Sets the modules' adapters from a directory ``save_expert_adapter`` wrote (to resume training)."""
    adapter = ExpertAdapter(path)
    for name, module in modules.items():
        w = module.wrapper
        m = re.search(r"layers\.(\d+)\.", name)
        lora = adapter.expert_lora(
            int(m.group(1)) if m else 0, w.num_experts, w.hidden_size, w.moe_intermediate_size
        )
        with torch.no_grad():
            for param, value in zip(module.adapters, lora.tensors(), strict=True):
                if param.shape != value.shape:
                    raise ValueError(
                        f"{path}: {name}'s adapters have shape {tuple(value.shape)}, the module's "
                        f"{tuple(param.shape)} (another rank?)"
                    )
                param.copy_(value)
