"""Long prompts' cold experts on the GPU: each layer's packed experts streamed over PCIe and computed
there (``--kt-gpu-prefill-token-threshold``).

A forward of at least ``threshold`` tokens sends its cold selections here instead of to the CPU
engine. The experts travel in the engine's packed layout, as the engine holds them (its memory is
registered as pinned once, in place), and are computed on the GPU from those bytes by Triton kernels
that dequantize in registers (kt_sglang/kernels/packed_moe_triton.py, every method of the engine); a
layout they do not cover is decoded a batch at a time into bf16 (kt_sglang/kernels/packed.py) and
computed by the hot-expert kernels. Copies run on a stream of their own into
two halves of one GPU buffer: while one half's experts compute, the next experts (the rest of this
layer, or the next MoE layer's first ones) are already moving. A half holds a whole layer where
GPU memory allows (``buffer_bytes`` caps it), else a layer passes through in rounds of as many experts
as a half holds; a half that still holds what a layer needs (a model of two MoE layers, the same
layer's next chunk) is not copied again. Experts on the GPU already (hot) never travel.

On the CPU device the same code runs with a host buffer, copies in order and the torch twins: CI
exercises the pipeline, and its output is the streaming path's output.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from dataclasses import dataclass

import torch

from kt_sglang.engine.activation import SILU
from kt_sglang.engine.inference import InferenceMoEWrapper
from kt_sglang.kernels import hot_moe
from kt_sglang.kernels.packed import PackedLayout, PackedPool, decode_experts

logger = logging.getLogger(__name__)

# Experts decoded to bf16 at once where the packed kernels do not compute a layout (and on the CPU
# device): bounds the scratch (Qwen3-30B-A3B: 150 MB).
DECODE_BATCH = 16
# Chunks with fewer selections than this many per held expert move only their routed experts: below
# it a good share of the experts is likely routed to by nothing.
ROUTED_ONLY = 2
# The staging buffer takes at most this share of the GPU memory free when the first long chunk comes
# (SGLang's KV cache has taken its share by then); the rest is for the decoded experts and activations.
FREE_MEMORY_SHARE = 0.5


def _host_bytes(address: int, size: int) -> torch.Tensor:
    """The engine's memory at ``address`` as a uint8 CPU tensor (no copy; valid while the layer lives)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)


class PackedExperts:
    """One layer's packed experts as the engine holds them: per pool, ``gate_up [held, bytes]`` and
    ``down [held, bytes]`` views of its memory, and which expert sits at which row."""

    def __init__(self, experts: InferenceMoEWrapper) -> None:
        view = experts.packed_view()
        pools = tuple(
            PackedPool(p["i_begin"], p["i_end"], p["gate_up_bytes"], p["down_bytes"]) for p in view["pools"]
        )
        self.layout = PackedLayout(
            method=experts.method,
            group=experts.group_size,
            down_method=experts.down_method,
            down_group=experts.down_group_size,
            hidden=experts.hidden_size,
            intermediate=experts.moe_intermediate_size,
            hidden_padded=view["hidden_padded"],
            gate_up_block=view["gate_up_block"],
            pools=pools,
        )
        self.layout.check()
        storage = view["storage"]
        self.held = [e for e, at in enumerate(storage) if at >= 0]  # by row
        rows = len(storage) and max(storage) + 1
        self.gate_up = [
            _host_bytes(p["gate_up"], rows * p["gate_up_bytes"]).view(rows, p["gate_up_bytes"])
            for p in view["pools"]
        ]
        self.down = [
            _host_bytes(p["down"], rows * p["down_bytes"]).view(rows, p["down_bytes"]) for p in view["pools"]
        ]
        self.row_of = {e: storage[e] for e in self.held}
        self.experts = experts
        self._pinned = False

    def pin(self) -> None:
        """Registers the engine's memory as pinned (once): copies from it then run at full speed and
        asynchronously. A read-only file mapping registers read-only."""
        if self._pinned:
            return
        cudart = torch.cuda.cudart()
        flags = 8 if self.experts.packed_view()["mapped"] else 0  # cudaHostRegisterReadOnly
        for t in self.gate_up + self.down:
            if t.numel():
                err = cudart.cudaHostRegister(t.data_ptr(), t.numel(), flags)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister of {t.numel()} bytes failed ({err})")
        self._pinned = True

    def expert_bytes(self) -> int:
        return self.layout.expert_bytes()


@dataclass
class PrefillStats:
    """What the streaming path did (tests, benchmarks, logs)."""

    layer_forwards: int = 0  # layer forwards computed by streaming
    experts_copied: int = 0  # experts copied into the staging buffer
    bytes_copied: int = 0


def _recorded(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event recorded on ``stream`` now (None on the CPU, where everything runs in order)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


@dataclass(eq=False)  # compared by identity
class _Half:
    """One half of the staging buffer and what it holds."""

    gate_up: list[torch.Tensor]  # per pool [slots, bytes] on the GPU
    down: list[torch.Tensor]
    copied: torch.cuda.Event | None = None  # the copy into it is done (CUDA)
    consumed: torch.cuda.Event | None = None  # the experts in it are computed: it may be refilled (CUDA)
    source: PackedExperts | None = None
    experts: list[int] | None = None


class GpuPrefill:
    """The streaming path shared by a model's MoE layers (one staging buffer, one copy stream).

    ``threshold``: forwards of at least this many tokens use it. ``buffer_bytes``: the staging
    buffer's size (both halves), None: two of the largest layer, or half the free GPU memory if less.
    ``device``: where the experts are computed (``cuda``: copies on a stream of their own; ``cpu``:
    host buffers, copies in order)."""

    def __init__(self, threshold: int, device: torch.device | str, buffer_bytes: int | None = None) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1 token, got {threshold}")
        self.threshold = threshold
        self.device = torch.device(device)
        self.buffer_bytes = buffer_bytes
        self._layers: list[PackedExperts] = []
        self._halves: list[_Half] = []
        self._slots = 0  # experts per half
        self._next = 0  # the half the next copy fills
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.disabled: str | None = None  # why the path fell back to the CPU engine, once said
        self.stats = PrefillStats()

    def add_layer(self, experts: InferenceMoEWrapper) -> PackedExperts | None:
        """This layer's experts, or None (with the reason logged once) when the path cannot compute
        them: another activation than plain SiLU, or expert biases."""
        reasons = []
        if experts.activation != SILU:
            reasons.append(f"the activation is {experts.activation}")
        if experts.has_biases():
            reasons.append("the experts have biases")
        if reasons:
            logger.warning(
                "kt-sglang: GPU prefill off for MoE layer %d (%s): its prompts run on the CPU engine",
                experts.layer_idx,
                " and ".join(reasons),
            )
            return None
        source = PackedExperts(experts)
        self._layers.append(source)
        return source

    # -- buffer --------------------------------------------------------------------------------

    def _ensure_buffer(self) -> bool:
        if self._halves:
            return True
        if self.disabled:
            return False
        per_expert = max(s.expert_bytes() for s in self._layers)
        layer_experts = max(len(s.held) for s in self._layers)
        wanted = self.buffer_bytes
        if wanted is None:  # two layers, within a share of what the GPU has free now
            wanted = 2 * per_expert * layer_experts
            if self.device.type == "cuda":
                wanted = min(wanted, int(FREE_MEMORY_SHARE * torch.cuda.mem_get_info(self.device)[0]))
        slots = min(max(layer_experts, 1), wanted // (2 * per_expert))
        if slots < 1:
            return self._disable(f"a buffer of {wanted} bytes holds no two experts ({per_expert} bytes each)")
        try:
            if self.device.type == "cuda":
                for source in self._layers:
                    source.pin()
            pools = self._layers[0].layout.pools
            for _ in range(2):
                self._halves.append(
                    _Half(
                        [
                            torch.empty(slots, p.gate_up_bytes, dtype=torch.uint8, device=self.device)
                            for p in pools
                        ],
                        [
                            torch.empty(slots, p.down_bytes, dtype=torch.uint8, device=self.device)
                            for p in pools
                        ],
                    )
                )
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
            self._halves.clear()
            gib = 2 * slots * per_expert / 2**30
            return self._disable(f"the staging buffer ({gib:.2f} GiB) did not fit: {exc}")
        self._slots = slots
        logger.info(
            "kt-sglang: GPU prefill from %d tokens, buffer %.2f GiB on %s (%d experts a half, %d a layer)",
            self.threshold,
            2 * slots * per_expert / 2**30,
            self.device,
            slots,
            layer_experts,
        )
        return True

    def _disable(self, why: str) -> bool:
        self.disabled = why
        logger.warning("kt-sglang: GPU prefill off, prompts run on the CPU engine: %s", why)
        return False

    def usable(self, source: PackedExperts | None) -> bool:
        return source is not None and self._ensure_buffer()

    # -- pipeline ------------------------------------------------------------------------------

    def _rounds(
        self, source: PackedExperts, hot: frozenset[int], routed: set[int] | None = None
    ) -> list[list[int]]:
        """The held experts not on the GPU (of ``routed``, when given), in groups of as many as a half
        of the buffer holds."""
        cold = [e for e in source.held if e not in hot and (routed is None or e in routed)]
        return [cold[i : i + self._slots] for i in range(0, len(cold), self._slots)]

    def _stage(self, source: PackedExperts, experts: list[int], busy: _Half | None) -> _Half:
        """The half holding ``experts`` of ``source``: one that holds them already (staged ahead by
        the previous layer, or left from an earlier forward: the weights do not change), else the
        half other than ``busy`` (the one computing), refilled on the copy stream after its last use."""
        for half in self._halves:
            if half.source is source and half.experts == experts:
                return half
        index = self._next if busy is None else 1 - self._halves.index(busy)
        half = self._halves[index]
        self._next = 1 - index
        rows = [source.row_of[e] for e in experts]
        stream = self._copy_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None and half.consumed is not None:
                stream.wait_event(half.consumed)
            for dst, src in zip(half.gate_up + half.down, source.gate_up + source.down, strict=True):
                _copy_rows(dst, src, rows)
            half.copied = _recorded(stream)
        half.source, half.experts = source, experts
        self.stats.experts_copied += len(experts)
        self.stats.bytes_copied += len(experts) * source.expert_bytes()
        return half

    def forward(
        self,
        source: PackedExperts,
        hidden: torch.Tensor,
        cold_ids: torch.Tensor,
        weights: torch.Tensor,
        hot: frozenset[int] = frozenset(),
        following: tuple[PackedExperts, frozenset[int]] | None = None,
    ) -> torch.Tensor:
        """fp32 ``[T, H]``: the selections of ``cold_ids [T, k]`` (-1 elsewhere) on their experts,
        streamed (the experts of ``hot`` are on the GPU already: they never travel); the first
        experts of ``following`` (the next MoE layer and its hot set) start moving while this
        layer's last ones compute."""
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        compute = torch.cuda.current_stream(self.device) if self._copy_stream is not None else None
        routed = None
        if cold_ids.numel() < ROUTED_ONLY * len(source.held):
            # Few selections for the experts (a chunk near a low threshold): read which are routed
            # (one small copy to the host) and move only those.
            routed = set(cold_ids[cold_ids >= 0].unique().tolist())
        rounds = self._rounds(source, hot, routed)
        staged = self._stage(source, rounds[0], None) if rounds else None
        for i, experts in enumerate(rounds):
            if i + 1 < len(rounds):
                ahead = self._stage(source, rounds[i + 1], staged)
            elif routed is None and following is not None and (next_rounds := self._rounds(*following)):
                ahead = self._stage(following[0], next_rounds[0], staged)
            else:
                ahead = None
            if compute is not None:
                compute.wait_event(staged.copied)
            n = len(experts)
            out += self._compute(
                source, [g[:n] for g in staged.gate_up], [d[:n] for d in staged.down], experts, hidden,
                cold_ids, weights,
            )  # fmt: skip
            staged.consumed = _recorded(compute)
            staged = ahead
        self.stats.layer_forwards += 1
        return out

    def _compute(
        self,
        source: PackedExperts,
        gate_up: list[torch.Tensor],
        down: list[torch.Tensor],
        experts: list[int],
        hidden: torch.Tensor,
        cold_ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """The selections of ``experts`` (whose packed bytes are ``gate_up``/``down``, rows in order):
        on CUDA by the packed kernels where they cover the layout (no decoded copy of the experts),
        else decoded to bf16 a batch at a time and computed by the hot-expert kernels."""
        E = source.experts.num_experts
        ids = torch.where(cold_ids >= 0, cold_ids, E).long()
        if hidden.is_cuda:
            from kt_sglang.kernels.packed_moe_triton import covers, packed_moe_triton

            if covers(source.layout):
                slots = _slot_ids(experts, E, ids)
                return packed_moe_triton(hidden, source.layout, gate_up, down, slots, weights)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for b0 in range(0, len(experts), DECODE_BATCH):
            batch = experts[b0 : b0 + DECODE_BATCH]
            w13, w2 = decode_experts(
                source.layout,
                [g[b0 : b0 + len(batch)] for g in gate_up],
                [d[b0 : b0 + len(batch)] for d in down],
                torch.bfloat16,
            )
            out += hot_moe(hidden, w13, w2, _slot_ids(batch, E, ids), weights)
        return out


def _slot_ids(experts: list[int], num_experts: int, ids: torch.Tensor) -> torch.Tensor:
    """Each selection's row among ``experts`` (-1: not one of them); ``ids [T, k]`` uses
    ``num_experts`` for no expert."""
    slot_of = torch.full((num_experts + 1,), -1, dtype=torch.int64)
    slot_of[torch.tensor(experts)] = torch.arange(len(experts))
    return slot_of.to(ids.device, non_blocking=True)[ids]


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, rows: list[int]) -> None:
    """``dst[i] = src[rows[i]]`` with one copy per run of consecutive rows."""
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        dst[i : j + 1].copy_(src[rows[i] : rows[j] + 1], non_blocking=True)
        i = j + 1


@dataclass(frozen=True)
class Crossover:
    """The measurements ``auto`` picks the threshold from, and the threshold."""

    h2d_gbps: float  # pinned host-to-device copy rate
    cpu_tokens_per_s: float  # the CPU engine's prefill rate on this layer
    layer_bytes: int  # the layer's cold experts' packed bytes
    threshold: int  # tokens where streaming the layer costs what the CPU engine takes

    def line(self) -> str:
        return (
            f"GPU prefill threshold {self.threshold} tokens (auto: CPU engine "
            f"{self.cpu_tokens_per_s:,.0f} tokens/s on a layer of {self.layer_bytes / 2**20:,.0f} MiB of "
            f"cold experts, pinned host-to-device {self.h2d_gbps:.1f} GB/s)"
        )


def measure_h2d_gbps(device: torch.device | str = "cuda", size: int = 256 << 20, repeats: int = 3) -> float:
    """The pinned host-to-device copy rate, best of ``repeats`` copies of ``size`` bytes."""
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms the path up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return size / best / 1e9


def measure_cpu_tokens_per_s(experts: InferenceMoEWrapper, tokens: int = 512) -> float:
    """The engine's prefill rate on this layer: one forward of ``tokens`` random tokens, after a
    warm-up, routed uniformly over the held experts."""
    gen = torch.Generator().manual_seed(0)
    k, E = experts.num_experts_per_tok, experts.num_experts
    hidden = (torch.randn(tokens, experts.hidden_size, generator=gen) / 4).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    ids = torch.where(torch.tensor([experts.holds(e) for e in range(E)])[ids], ids, -1)
    weights = torch.full((tokens, k), 1.0 / k)
    experts.forward(hidden[:16], ids[:16], weights[:16])
    start = time.perf_counter()
    experts.forward(hidden, ids, weights)
    return tokens / (time.perf_counter() - start)


def auto_crossover(
    experts: InferenceMoEWrapper, hot: frozenset[int], device: torch.device | str = "cuda"
) -> Crossover:
    """``--kt-gpu-prefill-token-threshold auto`` for a model whose MoE layers are like ``experts``:
    its cold experts' bytes, the CPU engine's rate on it and the pinned copy rate, measured now."""
    source = PackedExperts(experts)
    layer_bytes = sum(1 for e in source.held if e not in hot) * source.expert_bytes()
    return crossover(measure_h2d_gbps(device), measure_cpu_tokens_per_s(experts), layer_bytes)


def reference_crossover(device: torch.device | str = "cuda", threads: int | None = None) -> Crossover:
    """What ``auto`` would pick for a Qwen3-30B-A3B AMXINT4 layer on this machine (``kt-sglang
    doctor``): measured on a 16-expert slice of it, at 64 tokens, which gives each expert the rows a
    512-token chunk gives the whole layer's 128 (the same work per token, the same efficiency)."""
    from kt_sglang import KTMoEWrapper
    from kt_sglang.engine.pools import serving_threads

    E, full_E, k, H, I = 16, 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(0)
    experts = KTMoEWrapper(0, E, k, H, I, None, threads or serving_threads(), 1, method="AMXINT4")
    mats = [(torch.randn(E, N, K, generator=gen) / K**0.5).bfloat16() for N, K in ((I, H), (I, H), (H, I))]
    experts.load_weights_from_tensors(*mats)
    per_expert = PackedExperts(experts).expert_bytes()
    rate = measure_cpu_tokens_per_s(experts, tokens=64)
    return crossover(measure_h2d_gbps(device), rate, full_E * per_expert)


def crossover(h2d_gbps: float, cpu_tokens_per_s: float, layer_bytes: int) -> Crossover:
    """The chunk size where copying the layer's cold experts takes as long as the CPU engine computing
    that many tokens (the GPU's own compute hides under the copies; above it streaming wins)."""
    copy_s = layer_bytes / (h2d_gbps * 1e9)
    return Crossover(h2d_gbps, cpu_tokens_per_s, layer_bytes, max(1, round(copy_s * cpu_tokens_per_s)))
