"""A GGUF model as a source (``weights/gguf.py`` reads it): method LLAMAFILE computes each expert
tensor in its own GGUF type, so the file decides every layer's methods and groups; a layer's experts
are transcoded to canonical matrices a few at a time.

The reader (and the ``gguf`` package under it) is imported where a GGUF model is opened, not with
the package: it takes half a second to import."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kt_sglang.engine.methods import Method, parse_method
from kt_sglang.engine.weight_source import LayerMethods, ModelShape, WeightSource, register_source
from kt_sglang.weights.source import CheckpointError
from kt_sglang.weights.sources._slots import load_read, read_plan
from kt_sglang.weights.sources.hf_checkpoint import HfCheckpoint

if TYPE_CHECKING:
    from kt_sglang.engine.activation import Glu
    from kt_sglang.engine.base import BaseMoEWrapper
    from kt_sglang.engine.config import MoEConfig
    from kt_sglang.weights.gguf import GgufModel

# Canonical matrices transcoded per step from a GGUF file: the transient copies stay this small,
# whatever the layer's size.
GGUF_STEP_BYTES = 64 * 2**20


@register_source
class GgufSource(WeightSource):
    describes = "GGUF models (a .gguf file, the first of a split set, or a directory of one)"
    file_methods = ("LLAMAFILE",)
    supersedes = (HfCheckpoint,)  # a GGUF model kept in the Hugging Face model's directory

    @classmethod
    def claims(cls, path: Path) -> bool:
        return any(path.glob("*.gguf")) if path.is_dir() else path.suffix == ".gguf"

    def model(self) -> GgufModel:
        from kt_sglang.weights.gguf import open_gguf

        return open_gguf(self.path)

    def shape(self) -> ModelShape:
        return self.model().shape()

    def activation(self) -> Glu:
        return self.model().activation()

    def check_method(self, method: str | Method, flag: str = "method") -> None:
        name = method.value if isinstance(method, Method) else str(method).upper()
        if name not in self.file_methods:
            raise CheckpointError(
                f"{self.path} is a GGUF model: load it with {flag} LLAMAFILE (each tensor is computed in "
                "its own GGUF type)"
            )

    def check_adapter(self) -> None:
        raise CheckpointError(
            f"{self.path}: LLAMAFILE computes the GGUF file's values as they are; an expert adapter is "
            "merged into dense weights before quantizing: use a method the engine quantizes to"
        )

    def layer_methods(self, config: MoEConfig) -> LayerMethods:
        """The engine methods and groups of the layer's GGUF types (the tensors' shapes and the file's
        metadata checked against the configuration's); another method is refused at load."""
        if config.file_method is None:
            return LayerMethods(config.method, None)
        self.check_method(config.file_method)
        (method, group), (down_method, down_group) = self.model().layer_methods(
            config.layer_idx, config.num_experts, config.hidden_size, config.moe_intermediate_size
        )
        if config.group_size is not None and config.group_size != group:
            raise CheckpointError(
                f"group_size={config.group_size}: layer {config.layer_idx} of {self.path} is stored in "
                f"blocks of {group} ({method}); leave group_size unset"
            )
        return LayerMethods(parse_method(method), group, parse_method(down_method), down_group)

    def verify(self, method: str, model: ModelShape) -> None:
        weights = self.model()
        for layer in model.moe_layers:  # shapes, metadata and block types, layer by layer
            weights.layer_methods(layer, *model.sizes())

    def load(self, layer: BaseMoEWrapper, physical_to_logical_map: torch.Tensor | list[int] | None) -> None:
        self.check_method(layer.config.file_method or layer.method)
        if layer.expert_lora_path:
            self.check_adapter()
        model = self.model()
        if model.activation() != layer.activation:
            raise CheckpointError(
                f"{model.files[0]}: {model.architecture} experts use the activation {model.activation()}, "
                f"which conflicts with activation={layer.activation} given to the layer (leave it out to "
                "take the file's)"
            )
        model.check_layer(layer.layer_idx, layer.num_experts, layer.hidden_size, layer.moe_intermediate_size)
        needed, positions = read_plan(layer, physical_to_logical_map, layer.num_experts)
        if not needed:  # every expert on the GPU: nothing to read
            load_read(layer, [[], [], []], positions)
        step = max(
            1, GGUF_STEP_BYTES // (3 * layer.hidden_size * layer.moe_intermediate_size)
        )  # ~1 B a weight
        for first in range(0, len(needed), step):  # a few experts at a time
            chunk = model.read_experts(layer.layer_idx, needed[first : first + step])
            picked = [
                p - first if layer.holds(e) and first <= p < first + step else None
                for e, p in enumerate(positions)
            ]
            layer.load_canonical(
                *([m[p] if p is not None else None for p in picked] for m in chunk), partial=True
            )
        release_freed_memory()
        biases = model.read_biases(layer.layer_idx, needed) if needed else (None, None, None)
        if any(b is not None for b in biases):
            layer.load_biases(*(torch.from_numpy(b) if b is not None else None for b in biases), positions)


def release_freed_memory() -> None:
    """Hands the heap's freed pages back to the system (glibc keeps what a load's transient copies
    freed: a GGUF layer's canonical matrices left ~1.2x its packed bytes resident otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another C library: nothing to hand back this way
        pass
