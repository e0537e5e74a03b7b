"""LoRA on the CPU experts inside an ordinary PyTorch training loop.

:class:`LoRAExperts` is an ``nn.Module`` with the call of a transformers MoE block's ``experts``
(``hidden [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H]``): frozen experts in the engine
(any method), six ``nn.Parameter`` adapters ``[E, ...]``. ``loss.backward()`` reaches the engine's
backward through :class:`ExpertsFunction`, which returns the gradients to the hidden states and to the
routing weights (so the router trains) and has the engine add the adapters' gradients to their
``.grad`` in place (as torch accumulates them), without a dense gradient per call.
"""

from __future__ import annotations

import math

import torch

from kt_sglang.engine.config import SFTConfig
from kt_sglang.engine.sft import LORA_TENSORS, SavedForward, SFTMoEWrapper


class ExpertsFunction(torch.autograd.Function):
    """out = experts(hidden, topk_ids, topk_weights) with the engine's forward and backward. The
    adapters are inputs only so that autograd calls the backward even when nothing upstream trains;
    their gradients go to ``.grad`` directly (the function returns None for them)."""

    @staticmethod
    def forward(ctx, hidden, topk_weights, topk_ids, module: LoRAExperts, *adapters):
        module._sync_registration()
        out, saved = module.wrapper.forward_saved(hidden, topk_ids, topk_weights)
        ctx.module, ctx.saved = module, saved
        ctx.dtypes = (hidden.dtype, topk_weights.dtype, hidden.device)
        return out.to(device=hidden.device, dtype=hidden.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        module: LoRAExperts = ctx.module
        saved: SavedForward = ctx.saved
        hidden_dtype, weights_dtype, device = ctx.dtypes
        module._prepare_grads()
        grad_in, grad_w = module.wrapper.backward_saved(saved, grad_out)
        grads = (grad_in.to(device=device, dtype=hidden_dtype), grad_w.to(device=device, dtype=weights_dtype))
        return (*grads, None, None, *([None] * len(LORA_TENSORS)))


class LoRAExperts(torch.nn.Module):
    """Frozen routed experts on the CPU engine plus trainable LoRA adapters per expert.

    ``weights``: dense ``gate [E, I, H]``, ``up [E, I, H]``, ``down [E, H, I]`` (quantized to
    ``method`` on load), or ``weight_path`` as the inference wrapper reads it. ``method`` is one of
    ours or kt-kernel's SFT names (``AMXBF16_SFT``, ``AMXINT8_SFT``, ...). Adapters start as PEFT's do:
    A Kaiming-uniform, B zero (the layer starts equal to the frozen one). ``dtype`` is the adapters'
    (float32 masters by default; bfloat16 halves their memory).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        method: str = "BF16",
        rank: int = 16,
        alpha: float = 32.0,
        threads: int = 2,
        threadpool_count: int = 1,
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        weight_path: str | None = None,
        group_size: int | None = None,
        dtype: torch.dtype = torch.float32,
        max_cache_depth: int = 4,
        layer_idx: int = 0,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        config = SFTConfig(
            layer_idx, num_experts, top_k, hidden_size, intermediate_size, None, threads, threadpool_count,
            weight_path, method=method, lora_rank=rank, lora_alpha=alpha, max_cache_depth=max_cache_depth,
            group_size=group_size,
        )  # fmt: skip
        self.wrapper = SFTMoEWrapper(config)
        if weights is not None:
            gate, up, down = (w.detach().cpu().contiguous() for w in weights)
            self.wrapper.load_weights_from_tensors(gate, up, down)
        elif weight_path is not None:
            self.wrapper.load_weights()
        else:
            raise ValueError("LoRAExperts needs the frozen experts: weights=(gate, up, down) or weight_path")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, shape in self.wrapper.lora_shapes().items():
            t = torch.zeros(shape, dtype=torch.float32)
            if name.endswith("_a"):  # PEFT's init: kaiming_uniform_(a=sqrt(5)) -> U(-1/sqrt(in), 1/sqrt(in))
                bound = 1.0 / math.sqrt(shape[2])
                t.uniform_(-bound, bound, generator=gen)
            self.register_parameter(name, torch.nn.Parameter(t.to(dtype)))
        self._registered: tuple[int, ...] = ()

    @property
    def adapters(self) -> tuple[torch.nn.Parameter, ...]:
        return tuple(getattr(self, name) for name, _, _ in LORA_TENSORS)

    def _grad_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.grad if p.grad is not None else torch.zeros(0) for p in self.adapters)

    def _sync_registration(self) -> None:
        """Hands the engine the adapters' and gradients' current storage when it moved (an optimizer
        updates in place; ``zero_grad(set_to_none=True)`` drops the gradients)."""
        params = self.adapters
        for p in params:
            if p.device.type != "cpu" or not p.is_contiguous():
                raise RuntimeError(f"LoRA parameters must stay contiguous CPU tensors ({p.device})")
        grads = tuple(
            p.grad if p.grad is not None and p.grad.is_contiguous() and p.grad.dtype == p.dtype else None
            for p in params
        )
        key = tuple(p.data_ptr() for p in params) + tuple(g.data_ptr() if g is not None else 0 for g in grads)
        if key == self._registered:
            return
        if any(g is None for g in grads):  # a placeholder until the backward makes real ones
            grads = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True))
            self._placeholders = grads
        self.wrapper.init_lora_weights(*(p.detach() for p in params), *grads)
        self._registered = key

    def _prepare_grads(self) -> None:
        """Before a backward: every adapter has a zeroed ``.grad`` of its own storage for the engine
        to add to."""
        for p in self.adapters:
            if p.grad is None or not p.grad.is_contiguous() or p.grad.dtype != p.dtype:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        self._sync_registration()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        ids = top_k_index.reshape(hidden.shape[0], -1)
        weights = top_k_weights.reshape(hidden.shape[0], -1)
        if not torch.is_grad_enabled():
            self._sync_registration()
            out = self.wrapper.forward(hidden, ids, weights, save_for_backward=False)
            return out.to(device=hidden.device, dtype=hidden.dtype).reshape(shape)
        out = ExpertsFunction.apply(hidden, weights, ids, self, *self.adapters)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        w = self.wrapper
        return (
            f"experts={w.num_experts}, top_k={w.num_experts_per_tok}, hidden={w.hidden_size}, "
            f"intermediate={w.moe_intermediate_size}, method={w.method.value}, rank={w.lora_rank}, "
            f"alpha={w.lora_alpha}"
        )
