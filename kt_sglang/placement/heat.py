"""Placement by heat: each MoE layer's hot set follows its routing while serving.

- `ExpertHeat` (one layer) counts the layer's routed selections in a device tensor: `record` is a
  few device ops with no host sync, so it runs inside a captured CUDA graph too. Between steps the
  counts are folded into a decayed heat (``heat = heat * 0.5 ** (steps / half_life) + counts``) and
  copied to the host asynchronously; the host decides from the previous fold's copy, never waiting.
- `choose_moves` (hysteresis): the hottest cold expert replaces the coldest hot one only when its
  heat exceeds ``(1 + margin)`` times the other's plus one selection; at most ``max_moves`` per layer.
- `ExpertSlots` (one layer) moves experts without stalling a step: an incoming expert's weights are
  copied from their host copy into a spare slot, which no table entry names, on a side stream; once
  that copy has finished (an event the host polls), one in-place write of the slot table makes it
  hot and the outgoing expert's slot becomes the spare. The slot tensors and the table keep their
  storage, so CUDA graphs captured with them stay valid.
- `HeatPlacement` (one model) drives its layers: ``step()`` after every forward step. Heat decays
  per step, not per token: a larger batch gives more counts in the same window, not a shorter one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kt_sglang.layer.hybrid import HybridMoELayer

# A cold expert must also beat a hot one by one selection: with no history, a single selection
# would otherwise move an expert.
MIN_GAIN = 1.0


class HeatConfigError(ValueError):
    """A field of `HeatConfig` is out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


@dataclass(frozen=True)
class HeatConfig:
    # Heat
    half_life_steps: float = 128.0  # forward steps after which a selection weighs half
    # Re-choice
    margin: float = 0.25  # a cold expert must be (1 + margin) times as hot as the hot one it replaces
    interval_steps: int = 8  # steps between re-choices
    max_moves: int = 2  # moves per layer per re-choice, at most one per spare slot

    def __post_init__(self) -> None:
        if not (math.isfinite(self.half_life_steps) and self.half_life_steps > 0):
            raise HeatConfigError("half_life_steps", f"{self.half_life_steps}: use a number of steps > 0")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise HeatConfigError("margin", f"{self.margin}: use a fraction >= 0 (0.25: 25% hotter)")
        if isinstance(self.interval_steps, bool) or not isinstance(self.interval_steps, int):
            raise HeatConfigError("interval_steps", f"{self.interval_steps!r}: use an integer >= 1")
        if self.interval_steps < 1:
            raise HeatConfigError("interval_steps", f"{self.interval_steps}: use an integer >= 1")
        if isinstance(self.max_moves, bool) or not isinstance(self.max_moves, int) or self.max_moves < 1:
            raise HeatConfigError("max_moves", f"{self.max_moves!r}: use an integer >= 1")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class ExpertHeat:
    """One layer's routing counts (device) and decayed heat; see the module's docstring."""

    def __init__(self, num_experts: int, device: torch.device | str) -> None:
        device = torch.device(device)
        self.num_experts = num_experts
        # one bin more, where the -1 selections land (never read): three kernels a step, no mask
        self._bins = torch.zeros(num_experts + 1, dtype=torch.float32, device=device)
        self.counts = self._bins[:num_experts]
        self.heat = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self._host = torch.zeros(num_experts, dtype=torch.float32, pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None
        self._folds = 0

    def record(self, topk_ids: torch.Tensor, num_tokens: torch.Tensor | None = None) -> None:
        """Counts the selections of ``topk_ids`` ``[T, k]`` (-1: none); with ``num_tokens`` (int32
        ``[1]``, a CUDA graph's real batch size) only its first rows. No host sync."""
        ids = topk_ids
        if ids.device != self.counts.device:
            raise ValueError(f"topk_ids is on {ids.device}; the layer's heat is on {self.counts.device}")
        if num_tokens is not None:
            rows = torch.arange(ids.shape[0], device=ids.device) < num_tokens.to(ids.device)
            ids = torch.where(rows[:, None], ids, -1)
        bins = torch.remainder(ids.reshape(-1), self.num_experts + 1)  # -1 -> the last bin
        self._bins.index_add_(0, bins, torch.ones(bins.shape, dtype=torch.float32, device=bins.device))

    def fold(self, decay: float) -> None:
        """heat = heat * decay + counts, counts = 0, and the heat's copy to the host begun (in the
        current stream's order: after the steps that recorded)."""
        self.heat.mul_(decay).add_(self.counts)
        self._bins.zero_()
        if self.heat.is_cuda:
            if self._copied is not None and not self._copied.query():
                return  # the last copy is still being read into the host buffer: keep it
            self._host.copy_(self.heat, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host.copy_(self.heat)
        self._folds += 1

    def latest(self) -> torch.Tensor | None:
        """The heat as of the last fold whose copy has reached the host; None before any."""
        if self._folds == 0 or (self._copied is not None and not self._copied.query()):
            return None
        return self._host


def choose_moves(
    heat: torch.Tensor, hot: torch.Tensor, margin: float, max_moves: int
) -> list[tuple[int, int]]:
    """``(outgoing, incoming)`` expert pairs: the hottest cold experts replace the coldest hot ones,
    pair by pair, while ``heat[in] > (1 + margin) * heat[out] + MIN_GAIN``. heat ``[E]`` (host),
    hot ``[E]`` bool."""
    hot_ids = hot.nonzero().flatten()
    cold_ids = (~hot).nonzero().flatten()
    if hot_ids.numel() == 0 or cold_ids.numel() == 0:
        return []
    n = min(max_moves, hot_ids.numel(), cold_ids.numel())
    # ties: the lower id goes out / comes in first (stable sorts over ids in order)
    coldest_hot = hot_ids[torch.sort(heat[hot_ids], stable=True).indices[:n]]
    hottest_cold = cold_ids[torch.sort(heat[cold_ids], descending=True, stable=True).indices[:n]]
    moves = []
    for out, inc in zip(coldest_hot.tolist(), hottest_cold.tolist(), strict=True):
        if not float(heat[inc]) > (1 + margin) * float(heat[out]) + MIN_GAIN:
            break
        moves.append((out, inc))
    return moves


class ExpertSlots:
    """One layer's GPU slots: the slot table ``gpu_slot_of`` ``[E]`` (-1: cold), the slot tensors
    (first dimension: slots; e.g. w13, w2) and their host copies of every expert (first dimension:
    experts; pinned on CUDA), and ``spare`` slots no table entry names (the copies' targets)."""

    def __init__(
        self,
        gpu_slot_of: torch.Tensor,
        slot_tensors: list[torch.Tensor],
        host_tensors: list[torch.Tensor],
        spare: list[int],
    ) -> None:
        E = gpu_slot_of.shape[0]
        table = gpu_slot_of.to("cpu", torch.int64)
        used = table[table >= 0].tolist()
        if len(set(used)) != len(used):
            raise ValueError("gpu_slot_of names a slot twice")
        if len(slot_tensors) != len(host_tensors) or not slot_tensors:
            raise ValueError(f"{len(slot_tensors)} slot tensors, {len(host_tensors)} host copies: give pairs")
        S = slot_tensors[0].shape[0]
        if set(spare) & set(used) or len(set(spare)) != len(spare) or any(not 0 <= s < S for s in spare):
            raise ValueError(
                f"spare slots {spare} must be distinct slots in [0, {S}) that gpu_slot_of does not name"
            )
        if any(s >= S for s in used):
            raise ValueError(f"gpu_slot_of names slot {max(used)}; the slot tensors hold {S}")
        for n, (dev, host) in enumerate(zip(slot_tensors, host_tensors, strict=True)):
            if dev.shape[0] != S or tuple(host.shape) != (E, *dev.shape[1:]) or host.dtype != dev.dtype:
                raise ValueError(
                    f"slot tensor {n} is {tuple(dev.shape)} {dev.dtype}; its host copy must be "
                    f"[{E}, {', '.join(map(str, dev.shape[1:]))}] {dev.dtype} (and all hold {S} slots), "
                    f"got {tuple(host.shape)} {host.dtype}"
                )
            if host.device.type != "cpu":
                raise ValueError(f"host copy {n} is on {host.device}; it must be a CPU tensor")
        self.gpu_slot_of = gpu_slot_of
        self.slot_tensors, self.host_tensors = slot_tensors, host_tensors
        self.table = table  # the host's copy of the table: what the device holds once moves commit
        self.spare = list(spare)
        cuda = gpu_slot_of.is_cuda
        # the table written to the device from here: stable until that copy has run
        self._staged = torch.empty(E, dtype=torch.int64, pin_memory=cuda)
        self._side = torch.cuda.Stream(gpu_slot_of.device) if cuda else None
        self._copied: torch.cuda.Event | None = None  # the in-flight weight copies
        self._written: torch.cuda.Event | None = None  # the last table write
        self._inflight: list[tuple[int, int, int]] = []  # (outgoing, incoming, spare slot)
        self.moves = 0  # committed

    @property
    def hot(self) -> torch.Tensor:
        """``[E]`` bool: the experts the committed table names."""
        return self.table >= 0

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    def begin(self, moves: list[tuple[int, int]]) -> None:
        """Copies each incoming expert into a spare slot (side stream, after the work queued so far on
        the current stream, which may still read a slot a previous commit freed)."""
        if self._inflight:
            raise RuntimeError("moves are in flight: commit() them first")
        if len(moves) > len(self.spare):
            raise ValueError(f"{len(moves)} moves but {len(self.spare)} spare slots")
        for out, inc in moves:
            if self.table[out] < 0 or self.table[inc] >= 0:
                raise ValueError(f"move ({out} -> {inc}): expert {out} must be hot and {inc} cold")
        if not moves:
            return
        targets = self.spare[: len(moves)]
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.gpu_slot_of.device))
            with torch.cuda.stream(self._side):
                self._copy(moves, targets, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record()
        else:
            self._copy(moves, targets, non_blocking=False)
        self._inflight = [(out, inc, s) for (out, inc), s in zip(moves, targets, strict=True)]

    def _copy(self, moves: list[tuple[int, int]], targets: list[int], non_blocking: bool) -> None:
        for (_, inc), slot in zip(moves, targets, strict=True):
            for dev, host in zip(self.slot_tensors, self.host_tensors, strict=True):
                dev[slot].copy_(host[inc], non_blocking=non_blocking)

    def commit(self) -> int:
        """Once the in-flight copies have finished (never waits): writes the new table in place, in
        the current stream's order; returns the moves committed (0 while copies or the last table
        write are still running)."""
        if not self._inflight:
            return 0
        if self._copied is not None and not self._copied.query():
            return 0
        if self._written is not None and not self._written.query():
            return 0  # the staged table is still being read
        for out, inc, slot in self._inflight:
            freed = int(self.table[out])
            self.table[out], self.table[inc] = -1, slot
            self.spare[self.spare.index(slot)] = freed
        self._staged.copy_(self.table)
        if self._side is not None:
            self.gpu_slot_of.copy_(self._staged, non_blocking=True)
            self._written = torch.cuda.Event()
            self._written.record()
        else:
            self.gpu_slot_of.copy_(self._staged)
        n, self._inflight, self._copied = len(self._inflight), [], None
        self.moves += n
        return n


class HeatPlacement:
    """The heat placement of one model's MoE layers: call ``step()`` after each forward step."""

    def __init__(self, config: HeatConfig, layers: list[tuple[ExpertHeat, ExpertSlots]]) -> None:
        self.config = config
        self.layers = layers
        self.steps = 0

    @property
    def moves(self) -> int:
        """Moves committed so far, over all layers."""
        return sum(slots.moves for _, slots in self.layers)

    def step(self) -> int:
        """Counts a step; every ``interval_steps`` steps commits finished moves, re-chooses each
        layer's hot set from the latest heat on the host, begins the copies and folds the new counts.
        Returns the moves committed in this call."""
        self.steps += 1
        c = self.config
        if self.steps % c.interval_steps:
            return 0
        committed = 0
        decay = 0.5 ** (c.interval_steps / c.half_life_steps)
        for heat, slots in self.layers:
            committed += slots.commit()
            latest = heat.latest()
            if latest is not None and not slots.busy:
                moves = min(c.max_moves, len(slots.spare))  # a layer with every expert hot has none
                slots.begin(choose_moves(latest, slots.hot, c.margin, moves))
                committed += slots.commit()  # at once where the copies were synchronous
            heat.fold(decay)
        return committed


def spare_slots(gpu_slot_of: torch.Tensor, num_slots: int) -> list[int]:
    """The slots of ``num_slots`` that ``gpu_slot_of`` does not name."""
    used = set(gpu_slot_of[gpu_slot_of >= 0].tolist())
    return [s for s in range(num_slots) if s not in used]


def place_by_heat(
    layers: list[HybridMoELayer], host_weights: list[tuple[torch.Tensor, torch.Tensor]], config: HeatConfig
) -> HeatPlacement:
    """Heat placement of standalone `HybridMoELayer`s: each layer's routing is counted (``layer.heat``)
    and its w13 / w2 slots are refilled from ``host_weights`` (per layer, every expert's w13
    ``[E, 2I, H]`` and w2 ``[E, H, I]``, pinned for a CUDA layer); the slots the layer's table does
    not name are its spares. The engines must hold every expert (no ``gpu_experts_mask``)."""
    if len(host_weights) != len(layers):
        raise ValueError(f"{len(host_weights)} host weight pairs for {len(layers)} layers")
    parts = []
    for n, (layer, (w13, w2)) in enumerate(zip(layers, host_weights, strict=True)):
        mask = layer.experts.gpu_experts_mask
        if mask is not None and bool(mask.any()):
            raise ValueError(
                f"MoE layer {n}: its engine skips the experts of gpu_experts_mask; with placement by heat "
                "any expert may be cold at some step, so the engine must hold them all (no mask)"
            )
        heat = ExpertHeat(layer.gpu_slot_of.shape[0], layer.gpu_slot_of.device)
        spare = spare_slots(layer.gpu_slot_of, layer.w13.shape[0])
        parts.append((heat, ExpertSlots(layer.gpu_slot_of, [layer.w13, layer.w2], [w13, w2], spare)))
    placement = HeatPlacement(config, parts)
    for layer, (heat, slots) in zip(layers, parts, strict=True):
        layer.heat, layer.slots = heat, slots
    return placement
