"""A Hugging Face model directory as a source (``weights/checkpoint.py`` reads it): its experts taken
as they are by the method that reads their format, else quantized on load a few experts at a time,
with an expert adapter merged first where one is given."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kt_sglang.engine.methods import METHODS, Method
from kt_sglang.engine.weight_source import ModelShape, WeightSource, register_source
from kt_sglang.finetune.adapter import ExpertAdapter
from kt_sglang.weights import formats
from kt_sglang.weights.checkpoint import Checkpoint, open_checkpoint
from kt_sglang.weights.source import CheckpointError
from kt_sglang.weights.sources._slots import check_shape, load_read, read_plan

if TYPE_CHECKING:
    import torch

    from kt_sglang.engine.activation import Glu
    from kt_sglang.engine.base import BaseMoEWrapper

# Dense expert weights read per step when a checkpoint is quantized at load (at most the layer's
# packed bytes, so that a load's peak stays within one layer's worth of transient copies).
DENSE_STEP_BYTES = 256 * 2**20


@register_source
class HfCheckpoint(WeightSource):
    describes = "Hugging Face model directories (config.json)"

    @classmethod
    def claims(cls, path: Path) -> bool:
        return (path / "config.json").is_file()

    def checkpoint(self) -> Checkpoint:
        return open_checkpoint(self.path)

    def shape(self) -> ModelShape:
        return self.checkpoint().shape()

    def activation(self) -> Glu:
        return self.checkpoint().activation()

    def recorded_group(self, method: Method) -> int | None:
        """The group the config states for the experts of the method that reads them as they are
        (the INT4 formats; None for the others, whose group the method fixes)."""
        info = METHODS[method]
        if not any(f.states_group for f in formats.serving(info)):
            return None
        ckpt = self.checkpoint()
        layers = [la for la in ckpt.spec.moe_layers if ckpt.expert_format(la) == info.checkpoint_format]
        return ckpt.stated_group(layers[0]) if layers else None

    def verify(self, method: str, model: ModelShape) -> None:
        ckpt = self.checkpoint()
        ckpt.verify_files()
        if ckpt.spec.moe_layers:  # experts the readers know (a kt-kernel conversion is named now)
            ckpt.layer_format(ckpt.spec.moe_layers[0])

    def load(self, layer: BaseMoEWrapper, physical_to_logical_map: torch.Tensor | list[int] | None) -> None:
        ckpt = self.checkpoint()
        spec = ckpt.spec
        if ckpt.activation() != layer.activation:
            raise CheckpointError(
                f"{ckpt.path}: {ckpt.family.family} experts use the activation {ckpt.activation()}, which "
                f"conflicts with activation={layer.activation} given to the layer (leave it out to take the "
                "checkpoint's)"
            )
        check_shape(layer, ckpt.shape(), physical_to_logical_map is not None)
        needed, positions = read_plan(layer, physical_to_logical_map, spec.num_experts)
        # A method that reads the checkpoint's format takes its values as they are (no requantization);
        # from any other format the engine quantizes the dense (or dequantized) weights, if it can.
        info = METHODS[layer.method]
        in_layer = layer.layer_idx in spec.moe_layers
        fmt = ckpt.expert_format(layer.layer_idx) if in_layer else None
        if in_layer and (not info.quantizes_dense or fmt == info.checkpoint_format):
            if layer.expert_lora_path:
                raise CheckpointError(
                    f"{ckpt.path}: {layer.method.value} takes the checkpoint's {fmt} values as they are; an "
                    "expert adapter is merged into dense weights before quantizing: use a method the "
                    "engine quantizes to"
                )
            # INT4: the group the checkpoint's config states (a format the method does not read is
            # named by layer_native_experts)
            found = ckpt.stated_group(layer.layer_idx) if fmt == info.checkpoint_format else None
            if found is not None and found != layer.group_size:
                raise CheckpointError(
                    f"{ckpt.path}: its experts are quantized in groups of {found}; this layer was "
                    f"built with group_size={layer.group_size} (leave it unset to take the checkpoint's)"
                )
            load_read(layer, ckpt.layer_native_experts(layer.layer_idx, needed, layer.method), positions)
        elif in_layer and not needed:  # every expert on the GPU: nothing to read
            load_read(layer, [[], [], []], positions)
        else:  # a few experts at a time: the dense copies never add up to a layer
            per_expert = 3 * spec.hidden_size * spec.intermediate_size * 4  # bytes, fp32 at most
            step = max(1, min(DENSE_STEP_BYTES, layer.packed_bytes) // per_expert)
            for first in range(0, len(needed), step):
                chunk = needed[first : first + step]
                gate, up, down = ckpt.layer_experts(layer.layer_idx, chunk)
                if layer.expert_lora_path:
                    gate, up, down = _merge_adapter(layer, chunk, spec.num_experts, gate, up, down)
                held = range(first, first + len(chunk))  # positions of this chunk's experts
                mapping = [p - first if layer.holds(e) and p in held else -1 for e, p in enumerate(positions)]
                layer.load_weights_from_tensors(gate, up, down, mapping, partial=True)
        biases = ckpt.layer_biases(layer.layer_idx, needed) if in_layer and needed else (None, None, None)
        if any(b is not None for b in biases):
            layer.load_biases(*biases, physical_to_logical_map=positions)


def _merge_adapter(layer: BaseMoEWrapper, experts: list[int], num_experts: int, gate, up, down):
    """The experts' weights plus the adapter's scale * B A (float32), when it has this layer."""
    deltas = ExpertAdapter(layer.expert_lora_path).deltas(
        layer.layer_idx, experts, num_experts, layer.hidden_size, layer.moe_intermediate_size
    )
    if deltas is None:
        return gate, up, down
    return tuple((w.float() + d).contiguous() for w, d in zip((gate, up, down), deltas, strict=True))
