"""What the sources share to load a layer: which source experts its held slots read, handing the
matrices read to the layer, and the check of the source's shape against the layer's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    import torch

    from kt_sglang.engine.base import BaseMoEWrapper
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.engine.weight_source import ModelShape


def read_plan(
    layer: BaseMoEWrapper, physical_to_logical_map: torch.Tensor | list[int] | None, source_experts: int
) -> tuple[list[int], list[int]]:
    """(the source experts to read: those of the held slots, each once, in order; each slot's
    position among them, 0 for a slot not held)"""
    slots = layer.slot_map(physical_to_logical_map, source_experts) or list(range(layer.num_experts))
    needed = sorted({s for e, s in enumerate(slots) if layer.holds(e)})
    position = {s: i for i, s in enumerate(needed)}
    return needed, [position.get(s, 0) if layer.holds(e) else 0 for e, s in enumerate(slots)]


def load_read(layer: BaseMoEWrapper, mats: list[list[CanonicalMatrix]], positions: list[int]) -> None:
    """load_canonical of per-expert lists read for the held slots (positions from read_plan)."""
    layer.load_canonical(*([m[p] if layer.holds(e) else None for e, p in enumerate(positions)] for m in mats))


def check_shape(layer: BaseMoEWrapper, shape: ModelShape, mapped: bool) -> None:
    """The source's sizes are the layer's (its expert count too, unless a map names the slots')."""
    for name, ours, theirs in (
        ("hidden_size", layer.hidden_size, shape.hidden_size),
        ("moe_intermediate_size", layer.moe_intermediate_size, shape.intermediate_size),
    ):
        if ours != theirs:
            raise CheckpointError(f"{shape.where}: {name} is {theirs}; this layer was built with {ours}")
    if not mapped and shape.num_experts != layer.num_experts:
        raise CheckpointError(
            f"{shape.where}: the model has {shape.num_experts} experts, this layer {layer.num_experts}; "
            "pass physical_to_logical_map"
        )
