"""One MoE layer split between hot experts (GPU slots) and the CPU engine, with deferred experts.

out(L) = hot(L) + cold_now(L) + deferred(L_prev), all three fp32 and rounded once: the deferred
cold experts of MoE layer L are submitted to the engine with layer L's input, run while the next MoE
layer computes, and are added to that layer's output. Layers are linked explicitly (``next_moe``):
dense layers may sit between MoE layers, and the last MoE layer defers nothing. A chain holds at
most the one pending deferred task; a layer that is not its producer's successor (a new or aborted
pass) drains it and drops it.

On CUDA the split and the hot experts run as Triton kernels and the CPU engine's submit and sync
are ordered on the current stream (stream memory operations on pinned words, or host functions where
the driver lacks them): a forward never waits on the host, so a whole step with CPU experts and
deferral can be captured in one CUDA graph. On the CPU device the same code runs
the torch twins and the engine directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kt_sglang.engine.inference import InferenceMoEWrapper
from kt_sglang.kernels import hot_moe, split_routing
from kt_sglang.layer.prefill import GpuPrefill, PackedExperts

if TYPE_CHECKING:
    from kt_sglang.placement.heat import ExpertHeat, ExpertSlots

# hidden [T, H], slot_ids [T, k] (GPU slot of each hot selection, -1 elsewhere), weights [T, k]
# -> fp32 [T, H]
HotExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DeferralChain:
    """The pending deferred output of one model's MoE layers (two models never share one)."""

    def __init__(self) -> None:
        self._producer: HybridMoELayer | None = None

    def put(self, producer: HybridMoELayer) -> None:
        if self._producer is not None:
            raise RuntimeError("a deferred task is already pending: take() it before putting another")
        self._producer = producer

    def drop_stale(self, consumer: HybridMoELayer, hidden: torch.Tensor) -> None:
        """Drains and drops a pending task that ``consumer`` must not add (a new or aborted pass)."""
        if self._producer is not None and self._producer.next_moe is not consumer:
            self._producer.experts.sync_forward(hidden, _stream_of(hidden), deferred=True)
            self._producer = None

    def take(self, consumer: HybridMoELayer, hidden: torch.Tensor) -> torch.Tensor | None:
        """The pending deferred output if ``consumer`` follows its producer; drained either way."""
        self.drop_stale(consumer, hidden)
        producer, self._producer = self._producer, None
        if producer is None:
            return None
        return producer.experts.sync_forward(hidden, _stream_of(hidden), deferred=True)


def _stream_of(hidden: torch.Tensor) -> torch.cuda.Stream | None:
    """The stream the engine's host functions are ordered on: torch's current one, on CUDA."""
    return torch.cuda.current_stream(hidden.device) if hidden.is_cuda else None


# Batches of more tokens defer nothing by default. Measured on an H100 + Emerald Rapids host (MoE
# layers alone, docs/hardware-validation.md): deferral never paid at 128 tokens (x0.72-0.88) and paid
# at one token in one of two runs (up to x1.57); bench/bench_decode_step.py reports, per hot share,
# the largest batch where it pays (`deferral_pays_up_to`) on a model-shaped step.
DEFERRAL_MAX_TOKENS = 1


class HybridMoELayer(torch.nn.Module):
    """experts: the CPU engine's layer (all experts loaded), or None where another process computes
    the cold experts (a tensor-parallel rank other than 0: its output is its share of the hot experts,
    summed with the others by the framework's all-reduce); gpu_slot_of ``[E]``: the GPU slot of
    each hot expert, -1 for cold ones; w13 ``[S, 2I, H]`` / w2 ``[S, H, I]``: the hot experts' weights
    by slot; chain: shared by the model's MoE layers; deferral_max_tokens: the largest batch that
    defers (above it the deferred task would only add a dispatch and a second pass over weights the
    immediate task reads; None: every batch); heat: counts the layer's routing for placement by heat
    (kt_sglang/placement/heat.py; w13 / w2 then also hold its spare slots)."""

    def __init__(
        self,
        experts: InferenceMoEWrapper | None,
        gpu_slot_of: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        chain: DeferralChain,
        max_deferred_experts_per_token: int = 0,
        deferral_max_tokens: int | None = DEFERRAL_MAX_TOKENS,
        heat: ExpertHeat | None = None,
    ) -> None:
        super().__init__()
        E = gpu_slot_of.shape[0] if experts is None else experts.num_experts
        k = 1 if experts is None else experts.num_experts_per_tok  # no engine: nothing to defer
        if tuple(gpu_slot_of.shape) != (E,):
            raise ValueError(f"gpu_slot_of has shape {tuple(gpu_slot_of.shape)}; expected [{E}]")
        slots = int((gpu_slot_of >= 0).sum())
        if w13.shape[0] < slots or w2.shape[0] < slots:
            raise ValueError(f"{slots} hot experts but w13 / w2 hold {w13.shape[0]} / {w2.shape[0]} slots")
        if not 0 <= max_deferred_experts_per_token < max(k, 1):
            raise ValueError(f"max_deferred_experts_per_token must be in [0, {k - 1}]")
        if deferral_max_tokens is not None and deferral_max_tokens < 0:
            raise ValueError(f"deferral_max_tokens must be None or >= 0, got {deferral_max_tokens}")
        self.experts = experts
        if experts is not None:  # its partial sums stay fp32 until they meet the hot ones: one rounding
            experts.output_dtype = torch.float32
        self.register_buffer("gpu_slot_of", gpu_slot_of.to(torch.int64), persistent=False)
        # The slot table on the host too (reading the device's would sync): which experts a streamed
        # prefill leaves out. Placement by heat sets `slots`, whose table follows its moves.
        self._host_slot_of = gpu_slot_of.to("cpu", torch.int64)
        self.slots: ExpertSlots | None = None
        self.w13, self.w2 = w13, w2
        self.chain = chain
        self.max_deferred = max_deferred_experts_per_token
        self.deferral_max_tokens = deferral_max_tokens
        self.heat = heat
        self.next_moe: HybridMoELayer | None = None  # set by link()
        # Long prompts' cold experts streamed to the GPU (enable_gpu_prefill); None: the engine's.
        self.prefill: GpuPrefill | None = None
        self.prefill_source: PackedExperts | None = None

    @staticmethod
    def link(layers: list[HybridMoELayer]) -> None:
        """Declares the MoE layers of one model in order; the last one defers nothing."""
        for a, b in zip(layers, layers[1:], strict=False):
            a.next_moe = b
        if layers:
            layers[-1].next_moe = None

    @property
    def hot_experts(self) -> frozenset[int]:
        """The experts in GPU slots, from the host's copy of the slot table."""
        table = self.slots.table if self.slots is not None else self._host_slot_of
        return frozenset((table >= 0).nonzero().flatten().tolist())

    @staticmethod
    def enable_gpu_prefill(layers: list[HybridMoELayer], prefill: GpuPrefill) -> None:
        """Forwards of at least ``prefill.threshold`` tokens compute these layers' cold experts by
        streaming them to ``prefill.device`` (kt_sglang/layer/prefill.py)."""
        for layer in layers:
            layer.prefill = prefill
            layer.prefill_source = None if layer.experts is None else prefill.add_layer(layer.experts)

    def _streams(self, tokens: int) -> bool:
        prefill = self.prefill
        return prefill is not None and tokens >= prefill.threshold and prefill.usable(self.prefill_source)

    def hot_forward(
        self, hidden: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The hot experts' fp32 output from this layer's w13 / w2 (Triton on CUDA, torch elsewhere)."""
        return hot_moe(hidden, self.w13, self.w2, slot_ids, weights)

    def forward(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        num_tokens: torch.Tensor | None = None,
        hot: HotExperts | None = None,
    ) -> torch.Tensor:
        """``num_tokens`` (int32 ``[1]`` on the device): rows the CPU engine computes, all by
        default; under a CUDA graph captured at a larger size, the replay's real batch size.
        ``hot(hidden, slot_ids, weights)``: the hot experts' fp32 output (a serving framework's own
        GPU kernels: the SGLang plugin passes SGLang's MoE method), `hot_forward` by default."""
        if self.heat is not None:
            self.heat.record(topk_ids, num_tokens)
        if self.experts is None:  # the cold experts are another rank's
            split = split_routing(topk_ids, topk_weights, self.gpu_slot_of, 0)
            return (hot or self.hot_forward)(hidden, split.hot_ids, topk_weights).to(hidden.dtype)
        if self._streams(hidden.shape[0]):
            return self._streamed_forward(hidden, topk_ids, topk_weights, hot)
        stream = _stream_of(hidden)
        self.chain.drop_stale(self, hidden)  # before our own deferred submission reuses the buffers
        defers = self.next_moe is not None and (
            self.deferral_max_tokens is None or hidden.shape[0] <= self.deferral_max_tokens
        )  # a CUDA graph captures one batch size: the choice is fixed per graph
        max_deferred = self.max_deferred if defers else 0
        split = split_routing(topk_ids, topk_weights, self.gpu_slot_of, max_deferred)
        self.experts.submit_forward(hidden, split.cold_ids, topk_weights, stream, num_tokens=num_tokens)
        # Without host syncs on CUDA (graph capture): submit the deferred task even when it is empty.
        defer = max_deferred > 0 and (hidden.is_cuda or bool((split.deferred_ids >= 0).any()))
        if defer:
            self.experts.submit_forward(
                hidden, split.deferred_ids, topk_weights, stream, deferred=True, num_tokens=num_tokens
            )
        out = (hot or self.hot_forward)(hidden, split.hot_ids, topk_weights)
        out += self.experts.sync_forward(hidden, stream)
        previous = self.chain.take(self, hidden)
        if previous is not None:
            out += previous
        if defer:
            self.chain.put(self)
        return out.to(hidden.dtype)

    def _streamed_forward(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        hot: HotExperts | None,
    ) -> torch.Tensor:
        """A long chunk: the cold experts streamed to the GPU and computed there, nothing deferred;
        the next MoE layer's experts start moving while these compute."""
        self.chain.drop_stale(self, hidden)
        split = split_routing(topk_ids, topk_weights, self.gpu_slot_of, 0)
        nxt = self.next_moe
        following = (nxt.prefill_source, nxt.hot_experts) if nxt is not None and nxt.prefill_source else None
        out = (hot or self.hot_forward)(hidden, split.hot_ids, topk_weights)
        out += self.prefill.forward(
            self.prefill_source, hidden, split.cold_ids, topk_weights, self.hot_experts, following
        )
        previous = self.chain.take(self, hidden)
        if previous is not None:
            out += previous
        return out.to(hidden.dtype)
