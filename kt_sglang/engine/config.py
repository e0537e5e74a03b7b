"""The configuration of one layer's CPU experts: kt-kernel's constructor arguments, validated.

`MoEConfig` holds what the arguments alone decide (shapes, method, mask); what depends on the machine
(ISA, pools) or on the weights (their methods, recorded group size, activation) the layer resolves
when it is built, from its weight source. `SFTConfig` adds the fine-tuning layer's LoRA settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kt_sglang.engine.activation import SILU, Glu
from kt_sglang.engine.methods import FILE_METHODS, Method, parse_method, resolve_group

# What the engine's sizes hold (expert ids are int32 there); far past any model's.
_MAX_EXPERTS = 2**31 - 1
_MAX_DIM = 2**31 - 1

# kt-kernel's SFT method names -> our inference method of the frozen weights. Each also takes a
# "_SkipLoRA" suffix (the backward computes the input and routing-weight gradients only).
SFT_METHODS = {
    "AMXBF16_SFT": "BF16",
    "AMXINT8_SFT": "AMXINT8",
    "INT8_SFT": "AMXINT8",
    "AMXINT4_SFT": "AMXINT4",
    "AMXINT4_1_SFT": "AMXINT4",
    "AMXINT4_KGroup_SFT": "AMXINT4",
    "AMXINT4_1KGroup_SFT": "AMXINT4",
    "RAWINT4_SFT": "RAWINT4",
    "AMXFP8_SFT": "FP8",
    "MXFP4_SFT": "MXFP4",
}
SKIP_LORA_SUFFIX = "_SkipLoRA"


def parse_sft_method(method: str) -> tuple[str, bool]:
    """An SFT method name -> (inference method of the frozen weights, skip_lora). Our inference
    names (``BF16``, ``AMXINT8``, ...) are taken as they are."""
    skip = method.endswith(SKIP_LORA_SUFFIX)
    base = method[: -len(SKIP_LORA_SUFFIX)] if skip else method
    return SFT_METHODS.get(base, base), skip


@dataclass(frozen=True, eq=False)
class MoEConfig:
    """kt-kernel's ``KTMoEWrapper`` arguments, in its order (``cpu_save`` and
    ``max_deferred_experts_per_token`` are kept for callers; deferral belongs to the hybrid layer).

    Ours: ``group_size`` (quantization group; None: what a converted ``weight_path`` records, else
    the method's own), ``isa`` (kernel family; None: ``KT_SGLANG_ISA`` or the best the CPU runs),
    ``activation`` (None: the checkpoint's, else SiLU) and ``expert_lora_path`` (a PEFT adapter merged
    into the experts on load). After construction ``method`` is a `Method` (None with a
    ``file_method``) and ``gpu_experts_mask`` a contiguous bool CPU tensor (or None).

    ``method="LLAMAFILE"`` (kt-kernel's GGUF method) takes the layer's engine methods and groups from
    the weight file: ``file_method`` keeps the name given and ``method`` is None; the layer asks its
    weight source (engine/weight_source.py) for the methods and groups of gate/up and of down. The
    configuration itself reads no file.
    """

    # The layer's shape
    layer_idx: int
    num_experts: int
    num_experts_per_tok: int
    hidden_size: int
    moe_intermediate_size: int
    # Placement: the experts the GPU holds (not packed here) and the engine's workers
    gpu_experts_mask: torch.Tensor | None
    cpuinfer_threads: int
    threadpool_count: int
    # Weights and the engine
    weight_path: str | None = None
    chunked_prefill_size: int = 4096
    cpu_save: bool = False
    max_deferred_experts_per_token: int | None = None
    method: str | Method | None = "AMXINT4"
    numa_nodes: list[int] | None = None
    group_size: int | None = None
    isa: str | None = None
    activation: Glu | None = None
    expert_lora_path: str | None = None
    file_method: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        for name, value, largest in (
            ("num_experts", self.num_experts, _MAX_EXPERTS),
            ("num_experts_per_tok", self.num_experts_per_tok, _MAX_EXPERTS),
            ("hidden_size", self.hidden_size, _MAX_DIM),
            ("moe_intermediate_size", self.moe_intermediate_size, _MAX_DIM),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value > largest:
                raise ValueError(f"{name}={value} is larger than the engine takes (at most {largest})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} is larger than "
                f"num_experts={self.num_experts}"
            )
        if not isinstance(self.chunked_prefill_size, int) or self.chunked_prefill_size < 1:
            raise ValueError(
                f"chunked_prefill_size must be a positive integer, got {self.chunked_prefill_size!r}"
            )
        name = str(self.method).upper()
        if name in FILE_METHODS:  # the layer's source names the methods
            if self.weight_path is None:
                raise ValueError(
                    f"method {name} computes each GGUF tensor in its own type: give weight_path (a .gguf "
                    "file, the first of a split set, or a directory holding one model)"
                )
            object.__setattr__(self, "file_method", name)
            object.__setattr__(self, "method", None)
        else:
            method = parse_method(self.method)
            if self.group_size is not None:
                resolve_group(method, self.group_size)
            object.__setattr__(self, "method", method)
        object.__setattr__(self, "gpu_experts_mask", self._checked_mask(self.gpu_experts_mask))

    def _checked_mask(self, mask) -> torch.Tensor | None:
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor):
            mask = torch.as_tensor(mask)
        if mask.dtype != torch.bool:
            raise ValueError(f"gpu_experts_mask has dtype {mask.dtype}; expected torch.bool")
        if tuple(mask.shape) != (self.num_experts,):
            raise ValueError(f"gpu_experts_mask has shape {tuple(mask.shape)}; expected [{self.num_experts}]")
        return mask.to("cpu").contiguous()


@dataclass(frozen=True, eq=False)
class SFTConfig(MoEConfig):
    """kt-kernel's ``KTMoEWrapper(..., mode="sft")`` arguments: the frozen experts' (``method`` is an
    SFT name of :data:`SFT_METHODS` or an inference method; after construction it is the inference
    `Method` and ``sft_method`` the name given) and the LoRA adapters'. ``lora_dropout`` must be 0
    (dropout belongs to the caller's module), ``num_gpu_experts`` 0 (every expert is trained here);
    ``max_cache_depth`` bounds how many forwards may wait for their backward; ``zero_point`` is
    kt-kernel's and unused (the frozen weights' method says how they are stored).
    """

    gpu_experts_mask: torch.Tensor | None = None
    cpuinfer_threads: int = 1
    threadpool_count: int = 1
    method: str | Method = "AMXBF16_SFT"
    activation: Glu | None = SILU
    num_gpu_experts: int = 0
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    max_cache_depth: int = 1
    zero_point: bool = True
    sft_method: str = field(init=False)
    skip_lora: bool = field(init=False)

    def __post_init__(self) -> None:
        inference_method, skip_lora = parse_sft_method(str(self.method))
        object.__setattr__(self, "sft_method", str(self.method))
        object.__setattr__(self, "skip_lora", skip_lora)
        object.__setattr__(self, "method", inference_method)
        super().__post_init__()
        largest_rank = min(self.hidden_size, self.moe_intermediate_size)
        if not isinstance(self.lora_rank, int) or not 1 <= self.lora_rank <= largest_rank:
            raise ValueError(
                f"lora_rank={self.lora_rank!r} must be an integer in 1..{largest_rank} "
                "(at most the smaller of hidden_size and moe_intermediate_size)"
            )
        if self.lora_dropout != 0.0:
            raise ValueError("lora_dropout must be 0: apply dropout to the hidden states in your module")
        if self.num_gpu_experts != 0:
            raise ValueError("num_gpu_experts must be 0: every expert of an SFT layer is trained on the CPU")
        if not isinstance(self.max_cache_depth, int) or self.max_cache_depth < 1:
            raise ValueError(f"max_cache_depth must be a positive integer, got {self.max_cache_depth!r}")
        if self.activation != SILU:
            raise ValueError("fine-tuning supports the SiLU-gated experts (silu(gate) * up) only")
        if self.expert_lora_path is not None:
            raise ValueError(
                "expert_lora_path merges an adapter into inference weights; a fine-tuning layer trains "
                "its own (init_lora_weights)"
            )
        object.__setattr__(self, "lora_alpha", float(self.lora_alpha))
