"""Synthetic routing traces for placement: skewed (Zipf-like) per layer, the hot set drifting.

In each phase of ``phase_steps`` steps, expert e of a layer is chosen with a weight proportional to
``(rank(e) + 1) ** -skew``; at each new phase a ``drift`` share of the ranks is shuffled among
their experts (each layer on its own), so experts leave and join the hot set. A token picks
``top_k`` distinct experts. Used by the tests and by `bench/bench_decode_step.py --trace zipf`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ZipfTrace:
    num_experts: int
    top_k: int
    layers: int
    skew: float = 1.0
    phase_steps: int = 300
    drift: float = 0.5  # share of ranks reshuffled at each phase change (0: stationary)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.phase_steps < 1 or not 0.0 <= self.drift <= 1.0 or self.skew < 0:
            raise ValueError("phase_steps >= 1, drift in [0, 1] and skew >= 0")

    def steps(self, count: int, batch: int) -> list[list[torch.Tensor]]:
        """``count`` steps of ``batch`` tokens: per step, per layer, int64 ids ``[batch, top_k]``."""
        gen = torch.Generator().manual_seed(self.seed)
        E = self.num_experts
        by_rank = (torch.arange(E, dtype=torch.float64) + 1) ** -self.skew
        ranks = [torch.randperm(E, generator=gen) for _ in range(self.layers)]  # rank of each expert
        out = []
        for step in range(count):
            if step and step % self.phase_steps == 0:
                for r in ranks:
                    moved = torch.randperm(E, generator=gen)[: round(self.drift * E)]
                    r[moved] = r[moved[torch.randperm(moved.numel(), generator=gen)]]
            out.append(
                [torch.multinomial(by_rank[r].expand(batch, E), self.top_k, generator=gen) for r in ranks]
            )
        return out


def best_static(trace: list[list[torch.Tensor]], num_experts: int, hot: int) -> list[list[int]]:
    """Per layer, the ``hot`` experts routed to most over the whole trace (the best static choice in
    hindsight; ties: the lower id)."""
    totals = [torch.zeros(num_experts, dtype=torch.int64) for _ in trace[0]]
    for step in trace:
        for total, ids in zip(totals, step, strict=True):
            total += torch.bincount(ids[ids >= 0].flatten(), minlength=num_experts)
    return [sorted(torch.sort(-t, stable=True).indices[:hot].tolist()) for t in totals]


def served(ids: torch.Tensor, hot: torch.Tensor) -> tuple[int, int]:
    """(selections of ``ids`` whose expert ``hot`` ``[E]`` marks, all selections)."""
    valid = ids[ids >= 0]
    return int(hot[valid].sum()), int(valid.numel())
