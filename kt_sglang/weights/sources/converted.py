"""A directory `kt-sglang convert-cpu` wrote, as a source: its manifest (``kt_weights.json``) records
the model's shape, the method and the group; the experts are canonical matrices the engine repacks
(``weights/canonical_files.py``) or the engine's packed layout, mapped (``weights/packed_files.py``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from kt_sglang.engine.methods import Method
from kt_sglang.engine.weight_source import ModelShape, WeightSource, register_source
from kt_sglang.weights import packed_files
from kt_sglang.weights.canonical_files import MANIFEST, Manifest, read_layer, verify_files
from kt_sglang.weights.source import CheckpointError
from kt_sglang.weights.sources._slots import check_shape, load_read, read_plan
from kt_sglang.weights.sources.hf_checkpoint import HfCheckpoint

if TYPE_CHECKING:
    import torch

    from kt_sglang.engine.base import BaseMoEWrapper


@register_source
class ConvertedDirectory(WeightSource):
    describes = "directories `kt-sglang convert-cpu` wrote (kt_weights.json)"
    supersedes = (HfCheckpoint,)  # an earlier conversion into the model's own directory

    @classmethod
    def claims(cls, path: Path) -> bool:
        return (path / MANIFEST).is_file()

    @functools.cached_property
    def manifest(self) -> Manifest:
        return Manifest.read(self.path)

    def shape(self) -> ModelShape:
        m = self.manifest
        return ModelShape(
            m.num_experts, m.hidden_size, m.intermediate_size, tuple(m.moe_layers), str(self.path / MANIFEST)
        )

    def recorded_method(self) -> str:
        return self.manifest.method

    def recorded_group(self, method: Method) -> int | None:
        return self.manifest.group_size if self.manifest.method == method.value else None

    def check_adapter(self) -> None:
        raise CheckpointError(
            f"{self.path} holds converted weights; an expert adapter is merged into the checkpoint's "
            "dense weights before quantizing: load from the checkpoint itself"
        )

    def verify(self, method: str, model: ModelShape) -> None:
        m = self.manifest
        if m.method != method:
            raise CheckpointError(
                f"{self.path} holds {m.method} weights ({self.path / MANIFEST}); --kt-method is {method}: "
                "convert again or change --kt-method"
            )
        verify_files(self.path, m)

    def load(self, layer: BaseMoEWrapper, physical_to_logical_map: torch.Tensor | list[int] | None) -> None:
        if layer.expert_lora_path:
            self.check_adapter()
        m = self.manifest
        if m.method != layer.method.value or m.group_size != layer.group_size:
            raise CheckpointError(
                f"{self.path / MANIFEST}: converted for {m.method} group {m.group_size}; this layer uses "
                f"{layer.method.value} group {layer.group_size} (convert again or change --kt-method)"
            )
        check_shape(layer, self.shape(), physical_to_logical_map is not None)
        if m.layout == "packed":
            if layer.layer_idx not in m.moe_layers:
                raise CheckpointError(f"layer {layer.layer_idx} is not an MoE layer of {self.path}")
            slots = layer.slot_map(physical_to_logical_map, m.num_experts) or list(range(layer.num_experts))
            slot_to_file = [s if layer.holds(e) else -1 for e, s in enumerate(slots)]
            path = self.path / packed_files.packed_file(layer.layer_idx)
            header = packed_files.check_layer_file(
                path, m.method, m.group_size, layer.layer_idx, m.num_experts
            )
            packed_files.map_packed_layer(layer, path, header, slot_to_file)
            return
        needed, positions = read_plan(layer, physical_to_logical_map, m.num_experts)
        mats = read_layer(self.path, m, layer.layer_idx, needed)
        load_read(layer, [mats[p] for p in ("gate", "up", "down")], positions)
