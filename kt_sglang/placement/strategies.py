"""Placement strategies: a total budget of hot experts spread over a model's MoE layers.

- ``uniform``: the same count in every layer, experts 0..n-1 (upstream's placement).
- ``front-loading``: whole layers first, in layer order, until the budget is spent.
- ``random``: the same count in every layer, experts drawn with a fixed seed.
- ``frequency``: the same count in every layer, the experts routed to most often (statistics file).
- ``heat``: starts as ``frequency`` with a statistics file, else as ``uniform``; then the hot set
  follows the routing while serving (placement/heat.py).
"""

from __future__ import annotations

import random as _random

import torch

from kt_sglang.placement.stats import PlacementStats

STRATEGIES = ("uniform", "frequency", "front-loading", "random", "heat")

GIB = 1 << 30


def expert_bytes(hidden_size: int, intermediate_size: int, itemsize: int) -> int:
    """The GPU bytes of one routed expert: gate, up and down, ``itemsize`` bytes a weight."""
    return 3 * hidden_size * intermediate_size * itemsize


def slots_for_memory(memory_gib: float, num_moe_layers: int, one_expert: int, num_experts: int) -> int:
    """GPU slots per MoE layer that ``memory_gib`` holds over all MoE layers (at most every expert)."""
    return min(num_experts, int(memory_gib * GIB) // (max(num_moe_layers, 1) * one_expert))


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
    if strategy == "heat":  # its starting set
        strategy = "frequency" if stats is not None else "uniform"
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
