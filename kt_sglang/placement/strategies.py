"""Placement strategies: a total budget of hot experts spread over a model's MoE layers.

- ``uniform``: the same count in every layer, experts 0..n-1 (upstream's placement).
- ``front-loading``: whole layers first, in layer order, until the budget is spent.
- ``random``: the same count in every layer, experts drawn with a fixed seed.
- ``frequency``: the same count in every layer, the experts routed to most often (statistics file).
"""

from __future__ import annotations

import random as _random

import torch

from kt_sglang.placement.stats import PlacementStats

STRATEGIES = ("uniform", "frequency", "front-loading", "random")


def plan_hot_experts(
    strategy: str,
    moe_layers: list[int],
    num_experts: int,
    total_hot: int,
    stats: PlacementStats | None = None,
    seed: int = 0,
) -> dict[int, list[int]]:
    """Hot expert ids (sorted) of every MoE layer; ``total_hot`` is over all layers."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; use one of {list(STRATEGIES)}")
    capacity = num_experts * len(moe_layers)
    if not 0 <= total_hot <= capacity:
        raise ValueError(
            f"{total_hot} hot experts requested; the model has {num_experts} experts x "
            f"{len(moe_layers)} MoE layers = {capacity}"
        )
    if strategy == "front-loading":
        plan, left = {}, total_hot
        for layer in moe_layers:
            n = min(left, num_experts)
            plan[layer], left = list(range(n)), left - n
        return plan
    per_layer = total_hot // max(len(moe_layers), 1)
    if strategy == "uniform":
        return {layer: list(range(per_layer)) for layer in moe_layers}
    if strategy == "random":
        rng = _random.Random(seed)
        return {layer: sorted(rng.sample(range(num_experts), per_layer)) for layer in moe_layers}
    if stats is None:
        raise ValueError("the frequency strategy needs routing statistics (--kt-placement-stats FILE)")
    plan = {}
    for layer in moe_layers:
        counts = stats.counts(layer, num_experts)
        order = sorted(range(num_experts), key=lambda e: (-counts[e], e))  # ties: the lower id
        plan[layer] = sorted(order[:per_layer])
    return plan


def slot_map(hot: list[int], num_experts: int) -> torch.Tensor:
    """``[E]`` int64: the GPU slot of each hot expert (in id order), -1 for cold experts."""
    slots = torch.full((num_experts,), -1, dtype=torch.int64)
    for slot, expert in enumerate(sorted(hot)):
        slots[expert] = slot
    return slots
