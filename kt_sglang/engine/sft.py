"""Fine-tuning mode: LoRA adapters on one MoE layer's CPU experts, forward and backward.

``KTMoEWrapper(..., mode="sft", method="AMXBF16_SFT", lora_rank=16, lora_alpha=32.0)`` builds a
:class:`SFTMoEWrapper` from an `SFTConfig` (kt-kernel's constructor). The frozen experts are packed in
any inference method (kt-kernel's ``*_SFT`` names map onto ours: ``config.SFT_METHODS``); per expert
and projection the layer computes ``W x + (alpha / r) * B (A x)``. The adapters and their gradients
are caller-owned CPU tensors (``init_lora_weights``); ``backward`` adds to the gradients, as torch adds
to ``.grad``.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch

from kt_sglang.engine.base import BaseMoEWrapper, contiguous_as
from kt_sglang.engine.config import SFTConfig
from kt_sglang.engine.native import _native

# The adapters in kt-kernel's order: (name, rows, cols) with H hidden, I intermediate, r rank.
LORA_TENSORS = (
    ("gate_lora_a", "r", "H"),
    ("gate_lora_b", "I", "r"),
    ("up_lora_a", "r", "H"),
    ("up_lora_b", "I", "r"),
    ("down_lora_a", "r", "I"),
    ("down_lora_b", "H", "r"),
)
_LORA_DTYPES = {torch.float32: _native.DType.float32, torch.bfloat16: _native.DType.bfloat16}


class SavedForward:
    """What one forward kept for its backward. Dropping it (an abandoned step) frees the memory; a
    backward hands its buffers to the next forward (so one forward, one backward)."""

    __slots__ = ("native", "tokens", "__weakref__")

    def __init__(self, tokens: int, native: _native.SftSaved) -> None:
        self.native: _native.SftSaved | None = native
        self.tokens = tokens

    @property
    def nbytes(self) -> int:
        return self.native.nbytes if self.native is not None else 0


class SFTMoEWrapper(BaseMoEWrapper):
    """The CPU experts of one MoE layer with LoRA adapters, trainable.

    Weights load as in inference (``load_weights``, ``load_weights_from_tensors``,
    ``load_canonical``). The forward and backward are this layer's own: a forward keeps what its
    backward reads (``SavedForward``), at most ``max_cache_depth`` of them waiting.
    """

    def __init__(self, config: SFTConfig) -> None:
        super().__init__(config)
        self._sft = _native.SftMoe(self._layer, config.lora_rank, config.lora_alpha, config.skip_lora)
        self._lora: tuple[torch.Tensor, ...] | None = None
        self._grads: tuple[torch.Tensor, ...] | None = None
        self._live: weakref.WeakSet[SavedForward] = weakref.WeakSet()
        self._queue: deque[SavedForward] = deque()  # forward() -> backward(), oldest first
        self._spare: list[_native.SftSaved] = []  # buffers of finished backwards, reused (no page faults)
        self._pending_forward: tuple | None = None  # (task, output, saved, inputs kept alive)
        self._pending_backward: tuple | None = None  # (task, grad_in, grad_weights, inputs kept alive)

    # The fine-tuning configuration's fields, as kt-kernel's SFT wrapper names them.
    sft_method = property(lambda self: self.config.sft_method)
    skip_lora = property(lambda self: self.config.skip_lora)
    lora_rank = property(lambda self: self.config.lora_rank)
    lora_alpha = property(lambda self: self.config.lora_alpha)
    max_cache_depth = property(lambda self: self.config.max_cache_depth)

    # ----------------------------------------------------------------------------------------
    # Adapters

    def lora_shapes(self) -> dict[str, tuple[int, int, int]]:
        """Each adapter's shape ``[E, rows, cols]``, by kt-kernel's name."""
        sizes = {"r": self.lora_rank, "H": self.hidden_size, "I": self.moe_intermediate_size}
        return {name: (self.num_experts, sizes[a], sizes[b]) for name, a, b in LORA_TENSORS}

    def init_lora_weights(
        self,
        gate_lora_a: torch.Tensor,
        gate_lora_b: torch.Tensor,
        up_lora_a: torch.Tensor,
        up_lora_b: torch.Tensor,
        down_lora_a: torch.Tensor,
        down_lora_b: torch.Tensor,
        grad_gate_lora_a: torch.Tensor,
        grad_gate_lora_b: torch.Tensor,
        grad_up_lora_a: torch.Tensor,
        grad_up_lora_b: torch.Tensor,
        grad_down_lora_a: torch.Tensor,
        grad_down_lora_b: torch.Tensor,
    ) -> None:
        """Registers the adapters and their gradient tensors (kept by reference: update them in
        place, e.g. with an optimizer, and the next forward reads the new values). All twelve are
        contiguous CPU tensors of one dtype, float32 or bfloat16."""
        weights = (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b)
        grads = (grad_gate_lora_a, grad_gate_lora_b, grad_up_lora_a, grad_up_lora_b, grad_down_lora_a,
                 grad_down_lora_b)  # fmt: skip
        shapes = self.lora_shapes()
        dtype = gate_lora_a.dtype if isinstance(gate_lora_a, torch.Tensor) else None
        for prefix, tensors in (("", weights), ("grad_", grads)):
            for (name, _, _), t in zip(LORA_TENSORS, tensors, strict=True):
                name, expected = prefix + name, shapes[name]
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
                if tuple(t.shape) != expected:
                    raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {list(expected)}")
                if t.dtype not in _LORA_DTYPES:
                    raise ValueError(f"{name} has dtype {t.dtype}; LoRA tensors are float32 or bfloat16")
                if t.dtype != dtype:
                    raise ValueError(f"{name} has dtype {t.dtype} but gate_lora_a has {dtype}; use one dtype")
                if t.device.type != "cpu":
                    raise ValueError(
                        f"{name} is on {t.device}; LoRA tensors of the CPU experts live on the CPU"
                    )
                if not t.is_contiguous():
                    raise ValueError(f"{name} is not contiguous; call .contiguous() first")
        self._sft.set_lora(
            _LORA_DTYPES[dtype], [t.data_ptr() for t in weights], [t.data_ptr() for t in grads]
        )
        self._lora, self._grads = weights, grads

    def update_lora_weights(self) -> None:
        """Re-reads the registered tensors' addresses (after ``.data`` was replaced)."""
        if self._lora is None:
            raise RuntimeError("init_lora_weights first")
        self.init_lora_weights(*self._lora, *self._grads)

    # ----------------------------------------------------------------------------------------
    # Forward and backward

    @property
    def cache_depth(self) -> int:
        """Forwards whose saved state is alive and waiting for a backward."""
        return len(self._live)

    def _check_sft_inputs(self, hidden_states, expert_ids, weights) -> int:
        T = self._check_inputs(hidden_states, expert_ids, weights, ids_checked_by_engine=True)
        if T == 0:
            raise ValueError("hidden_states has no tokens")
        return T

    def submit_forward(
        self,
        hidden_states: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        save_for_backward: bool = True,
    ) -> SavedForward | None:
        """Enqueues a forward; ``sync_forward`` returns its output. With ``save_for_backward`` it
        returns the state a backward reads (kept alive by the caller, or queued for ``backward``)."""
        if self._pending_forward is not None:
            raise RuntimeError("a forward is already pending; call sync_forward() first")
        T = self._check_sft_inputs(hidden_states, expert_ids, weights)
        if save_for_backward and self.cache_depth >= self.max_cache_depth:
            raise RuntimeError(
                f"{self.cache_depth} forwards already wait for their backward (max_cache_depth="
                f"{self.max_cache_depth}); run their backward, clear_cache(), or raise max_cache_depth"
            )
        x = contiguous_as(hidden_states.detach().cpu(), torch.bfloat16)
        ids = contiguous_as(expert_ids.cpu(), expert_ids.dtype)
        w = contiguous_as(weights.detach().cpu(), torch.float32)
        out = torch.empty(T, self.hidden_size, dtype=torch.bfloat16)
        saved = None
        if save_for_backward:
            saved = SavedForward(T, self._spare.pop() if self._spare else _native.SftSaved())
        task = self._sft.submit_forward(
            T, x.data_ptr(), ids.data_ptr(), ids.dtype == torch.int64, w.data_ptr(), self._mask_ptr(),
            out.data_ptr(), saved.native if saved is not None else None,
        )  # fmt: skip
        if saved is not None:
            self._live.add(saved)
        # The inputs stay referenced until the task has run.
        self._pending_forward = (task, out, saved, (x, ids, w))
        return saved

    def sync_forward(self, output_device: torch.device | None = None) -> torch.Tensor:
        """Waits for the pending forward; its output ``[T, H]`` bf16."""
        if self._pending_forward is None:
            raise RuntimeError("no pending forward; call submit_forward() first")
        task, out, saved, _ = self._pending_forward
        self._pending_forward = None
        self._runner.wait(task)
        if saved is not None:
            self._queue.append(saved)
        return out if output_device is None else out.to(output_device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        save_for_backward: bool = True,
        output_device: torch.device | None = None,
    ) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_j(hidden[t])`` with the adapters; ``[T, H]`` bf16. With
        ``save_for_backward`` the next ``backward`` (oldest first) uses what it keeps."""
        self.submit_forward(hidden_states, expert_ids, weights, save_for_backward)
        return self.sync_forward(output_device)

    def forward_saved(
        self, hidden_states: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, SavedForward]:
        """A forward that hands its saved state to the caller (``backward_saved``) instead of the
        queue: what the autograd function uses, so that a dropped graph frees it."""
        saved = self.submit_forward(hidden_states, expert_ids, weights, True)
        out = self.sync_forward()
        self._queue.remove(saved)
        return out, saved

    def submit_backward_async(self, grad_output: torch.Tensor, saved: SavedForward | None = None) -> None:
        """Enqueues the backward of ``saved`` (default: the oldest queued forward)."""
        if self._pending_backward is not None:
            raise RuntimeError("a backward is already pending; call sync_backward() first")
        if saved is None:
            if not self._queue:
                raise RuntimeError("no forward cache available: call forward(save_for_backward=True) first")
            saved = self._queue.popleft()
        if saved.native is None:
            raise RuntimeError("this forward's backward already ran (its saved state is released after one)")
        T = saved.tokens
        if not isinstance(grad_output, torch.Tensor) or tuple(grad_output.shape) != (T, self.hidden_size):
            shape = tuple(grad_output.shape) if isinstance(grad_output, torch.Tensor) else type(grad_output)
            raise ValueError(f"grad_output has shape {shape}; expected [{T}, {self.hidden_size}]")
        if self._lora is not None and not self.skip_lora:
            for t in self._grads:  # the engine adds into these
                if t.device.type != "cpu":
                    raise RuntimeError("the LoRA gradients moved off the CPU; call init_lora_weights again")
        dy = contiguous_as(grad_output.detach().cpu(), torch.bfloat16)
        grad_in = torch.empty(T, self.hidden_size, dtype=torch.float32)
        grad_w = torch.empty(T, self.num_experts_per_tok, dtype=torch.float32)
        task = self._sft.submit_backward(saved.native, dy.data_ptr(), grad_in.data_ptr(), grad_w.data_ptr())
        self._pending_backward = (task, grad_in, grad_w, (dy, saved))

    def sync_backward(self, output_device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Waits for the pending backward: (grad_input ``[T, H]``, grad_weights ``[T, k]``), fp32."""
        if self._pending_backward is None:
            raise RuntimeError("no pending backward; call submit_backward_async() first")
        task, grad_in, grad_w, (_, saved) = self._pending_backward
        self._pending_backward = None
        self._runner.wait(task)
        self._live.discard(saved)
        if len(self._spare) < self.max_cache_depth:
            self._spare.append(saved.native)
        saved.native = None
        if output_device is not None:
            grad_in, grad_w = grad_in.to(output_device), grad_w.to(output_device)
        return grad_in, grad_w

    def backward(
        self, grad_output: torch.Tensor, output_device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The backward of the oldest queued forward: (grad_input, grad_weights); adds the
        adapters' gradients to the registered gradient tensors."""
        self.submit_backward_async(grad_output)
        return self.sync_backward(output_device)

    def backward_saved(
        self, saved: SavedForward, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The backward of a ``forward_saved``."""
        self.submit_backward_async(grad_output, saved)
        return self.sync_backward()

    def clear_cache(self) -> None:
        """Drops every queued forward's saved state (an abandoned step)."""
        self._queue.clear()

    def drain(self) -> None:
        """Waits until every forward and backward this layer submitted has finished."""
        self._sft.drain()
        super().drain()
