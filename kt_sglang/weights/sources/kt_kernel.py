"""A directory kt-kernel converted, as a source (``weights/kt_kernel_files.py`` reads it): its INT8 /
INT4 experts with one scale per row, taken by ``--kt-method AMXINT8`` / ``AMXINT4`` as they are, in
whatever NUMA split kt-kernel wrote them; the engine splits them for its own pools."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from kt_sglang.engine.methods import METHODS, Method, parse_method
from kt_sglang.engine.weight_source import LayerMethods, ModelShape, WeightSource, register_source
from kt_sglang.weights.kt_kernel_files import PROJECTIONS, KtKernelDir, looks_like_kt_kernel, whole_row_group
from kt_sglang.weights.source import CheckpointError
from kt_sglang.weights.sources._slots import check_shape, read_plan
from kt_sglang.weights.sources.hf_checkpoint import HfCheckpoint

if TYPE_CHECKING:
    import torch

    from kt_sglang.engine.base import BaseMoEWrapper
    from kt_sglang.engine.config import MoEConfig

# kt-kernel's bytes read per step (the canonical copies of a step are as large): a layer is never
# held twice.
STEP_BYTES = 64 * 2**20


@register_source
class KtKernelDirectory(WeightSource):
    describes = (
        "directories kt-kernel converted (_layer_L/_numa_N/*.kt files, or safetensors of "
        "blk.L.ffn_*_exps.E.numa.N tensors)"
    )
    supersedes = (HfCheckpoint,)  # its converter copies the model's config.json beside the experts

    @classmethod
    def claims(cls, path: Path) -> bool:
        return looks_like_kt_kernel(path)

    @functools.cached_property
    def files(self) -> KtKernelDir:
        return KtKernelDir(self.path)

    def shape(self) -> ModelShape:
        experts, hidden, intermediate = self.files.sizes()
        return ModelShape(experts, hidden, intermediate, tuple(self.files.layers), str(self.path))

    def recorded_method(self) -> str:
        return self.files.method()

    def recorded_group(self, method: Method) -> int | None:
        """The group that carries each row's one scale: the largest the method allows that divides
        hidden_size and a NUMA part's intermediate slice."""
        if method.value != self.files.method():
            return None
        _, hidden, intermediate = self.files.sizes()
        parts = max(self.files.parts(layer) for layer in self.files.layers)
        return whole_row_group(METHODS[method].allowed_groups, hidden, intermediate // parts)

    def layer_methods(self, config: MoEConfig) -> LayerMethods:
        """The directory's method in the group that carries each row's scale, its inputs quantized
        with one scale per token (gate/up) and per row of h (down), as kt-kernel computes them."""
        methods = super().layer_methods(config)
        return dataclasses.replace(methods, int8_input_per_row=True)

    def check_adapter(self) -> None:
        raise CheckpointError(
            f"{self.path} holds kt-kernel's quantized experts; an expert adapter is merged into dense "
            "weights before quantizing: load from the model's checkpoint"
        )

    def check_method(self, method: str | Method, flag: str = "method") -> None:
        """Only the directory's own method reads it: kt-kernel's INT8 / INT4 values as they are."""
        method = parse_method(method).value  # aliases too: INT8, MOE_INT8
        if method != self.files.method():
            raise CheckpointError(
                f"{self.path} holds kt-kernel {self.files.type_name} experts ({self.files.method()}); "
                f"{flag} is {method}"
            )

    def verify(self, method: str, model: ModelShape) -> None:
        self.check_method(method, "--kt-method")
        for layer in model.moe_layers:  # every expert's files there, of the sizes the model gives
            self.files.check_layer(
                layer, model.hidden_size, model.intermediate_size, model.num_experts, method
            )

    def load(self, layer: BaseMoEWrapper, physical_to_logical_map: torch.Tensor | list[int] | None) -> None:
        if layer.expert_lora_path:
            self.check_adapter()
        self.check_method(layer.method)
        group = self.recorded_group(layer.method)
        if layer.group_size != group:
            raise CheckpointError(
                f"{self.path}: kt-kernel's experts have one scale per row, carried by groups of {group}; "
                f"this layer was built with group_size={layer.group_size} (leave it unset)"
            )
        mapped = physical_to_logical_map is not None
        check_shape(layer, self.shape(), mapped)
        idx, H, I = layer.layer_idx, layer.hidden_size, layer.moe_intermediate_size
        source_experts = self.files.experts(idx)
        self.files.check_layer(idx, H, I, source_experts, layer.method.value)
        needed, positions = read_plan(layer, physical_to_logical_map, source_experts)
        per_expert = 3 * H * I * METHODS[layer.method].weight_bits // 8
        step = max(1, int(STEP_BYTES // per_expert))
        if not needed:  # every expert on the GPU: nothing to read
            layer.load_canonical(
                [None] * layer.num_experts, [None] * layer.num_experts, [None] * layer.num_experts
            )
        for first in range(0, len(needed), step):  # a few experts at a time
            chunk = needed[first : first + step]
            mats = [self.files.read(idx, proj, chunk, H, I, group) for proj in PROJECTIONS]
            picked = [
                p - first if layer.holds(e) and first <= p < first + step else None
                for e, p in enumerate(positions)
            ]
            layer.load_canonical(
                *([m[p] if p is not None else None for p in picked] for m in mats), partial=True
            )
