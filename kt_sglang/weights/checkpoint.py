"""A Hugging Face model directory as users have it: config.json, one or many safetensors shards.

The model-level reading: the family (``configs/models``) names the expert tensors and the config
keys, the spec says which layers are MoE layers and their sizes, and each layer's experts are read
by the format the registry (``kt_sglang.weights.formats``) detects on it. Tensors are read lazily
(``TensorSource``): only the experts of the layer being loaded are ever materialized.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kt_sglang.engine.weight_source import ModelShape
from kt_sglang.weights import formats
from kt_sglang.weights.families import ModelFamily, family_for
from kt_sglang.weights.source import CheckpointError, TensorSource, unreadable

if TYPE_CHECKING:  # imported where used: reading a checkpoint needs no native engine
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.engine.methods import Method
    from kt_sglang.weights.formats import ExpertFormat


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    moe_layers: tuple[int, ...]


class Checkpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path} does not exist: not a Hugging Face model directory")
        if (reason := unreadable(config_path)) is not None:
            raise CheckpointError(f"cannot read {config_path}: {reason}")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
        # Multimodal checkpoints keep the language model's settings under text_config.
        self.config: dict = {**raw, **raw.get("text_config", {})} if "text_config" in raw else raw
        self.quantization: dict = (
            raw.get("quantization_config") or self.config.get("quantization_config") or {}
        )
        self.family: ModelFamily = family_for(self.config.get("model_type", raw.get("model_type", "")))
        self.source = TensorSource(self.path)
        self.spec = self._read_spec()

    def _read_spec(self) -> MoeSpec:
        fam, cfg = self.family, self.config
        try:
            values = {name: int(fam.config_value(cfg, name)) for name in fam.config}
        except KeyError as exc:
            raise CheckpointError(f"{self.path / 'config.json'}: {exc.args[0]}") from exc
        layers = tuple(l for l in range(values["num_layers"]) if fam.is_moe_layer(cfg, l))
        return MoeSpec(
            values["num_experts"],
            values["top_k"],
            values["hidden_size"],
            values["intermediate_size"],
            values["num_layers"],
            layers,
        )

    def shape(self) -> ModelShape:
        """The MoE shape the config gives."""
        spec = self.spec
        return ModelShape(
            spec.num_experts,
            spec.hidden_size,
            spec.intermediate_size,
            spec.moe_layers,
            str(self.path / "config.json"),
        )

    def verify_files(self) -> None:
        """Opens every shard (headers only): a truncated file is named now, not at first use."""
        self.source.verify_files()

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each expert projection's ``[N, K]``: gate and up ``[I, H]``, down ``[H, I]``."""
        I, H = self.spec.intermediate_size, self.spec.hidden_size
        return {"gate": (I, H), "up": (I, H), "down": (H, I)}

    def _check_moe_layer(self, layer: int) -> None:
        if layer not in self.spec.moe_layers:
            raise CheckpointError(
                f"layer {layer} is not an MoE layer of {self.path.name} "
                f"(MoE layers: {list(self.spec.moe_layers)})"
            )

    # ------------------------------------------------------------------------------------------
    # What the layer's experts are stored as

    def layer_format(self, layer: int) -> ExpertFormat:
        """The format of the layer's experts (the first of the registry that detects itself)."""
        found = formats.detect(self, layer)
        if found is None:
            pattern = self.family.experts.get("gate", "").format(layer=layer, expert=0)
            raise CheckpointError(
                f"layer {layer}: no expert tensors ({pattern} or fused gate_up_proj) in {self.path}"
            )
        return found

    def expert_format(self, layer: int) -> str:
        """How the layer's experts are stored, as MethodInfo.checkpoint_format names it: "dense"
        (bf16/fp16/fp32), "fp8", "pack-quantized", "gptq", "mxfp4", "nvfp4"."""
        return self.layer_format(layer).name

    def expert_dtype(self, layer: int) -> torch.dtype:
        """The stored dtype of the layer's expert weights (before any dequantization; int32 for the
        packed INT4 formats)."""
        return self.layer_format(layer).stored_dtype(self, layer)

    def stated_group(self, layer: int) -> int | None:
        """The group size the checkpoint's config states for the layer's experts (the INT4 formats;
        None for the others, whose group the method fixes)."""
        return self.layer_format(layer).stated_group(self, layer)

    def expert_tensor_names(self) -> list[str]:
        """Names of every expert tensor in the checkpoint (records which checkpoint a conversion used)."""
        return sorted(name for name in self.source.names() if ".experts." in name)

    def activation(self):
        """The experts' activation (kt_sglang.engine.activation.Glu), from the family and config."""
        return self.family.glu(self.config)

    # ------------------------------------------------------------------------------------------
    # Values, for the methods that quantize

    def layer_experts(
        self, layer: int, experts: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up ``[n, I, H]`` and down ``[n, H, I]`` of the given experts (all by default), as
        bf16/fp16/fp32 (float32 where the checkpoint's codes were dequantized)."""
        self._check_moe_layer(layer)
        ids = list(range(self.spec.num_experts)) if experts is None else list(experts)
        return self.layer_format(layer).values(self, layer, ids)

    def iter_experts(self, layer: int):
        """Yields (gate [I, H], up [I, H], down [H, I]) expert by expert: the converter's streaming read,
        which never holds a whole layer of per-expert checkpoints in memory."""
        self._check_moe_layer(layer)
        yield from self.layer_format(layer).iter_values(self, layer)

    def layer_biases(self, layer: int, experts: list[int]):
        """gate, up ``[n, I]`` and down ``[n, H]`` fp32 biases of the given experts (gpt-oss); None
        where the model has none."""
        return self.layer_format(layer).biases(self, layer, experts)

    # ------------------------------------------------------------------------------------------
    # Canonical matrices, for the method that takes the checkpoint's values as they are

    def _native_format(self, layer: int, method: Method) -> ExpertFormat:
        """The layer's format, after checking that ``method`` takes it as it is."""
        from kt_sglang.engine.methods import METHODS

        if METHODS[method].checkpoint_format is None:
            raise ValueError(f"{method.value} quantizes dense weights; it reads no checkpoint format as is")
        self._check_moe_layer(layer)
        found = self.layer_format(layer)
        if not found.serves(METHODS[method]):
            raise found.refusal(self, layer, method)
        return found

    def layer_native_experts(
        self, layer: int, experts: list[int], method: Method
    ) -> tuple[list[CanonicalMatrix], list[CanonicalMatrix], list[CanonicalMatrix]]:
        """gate, up, down canonical matrices of the given experts for a method that takes this
        checkpoint's values as they are (``MethodInfo.checkpoint_format``)."""
        return self._native_format(layer, method).native(self, layer, list(experts), method)

    def iter_native_experts(self, layer: int, method: Method):
        """Yields (gate, up, down) canonical matrices expert by expert (the converter's stream)."""
        yield from self._native_format(layer, method).iter_native(self, layer, method)


@functools.lru_cache(maxsize=4)
def open_checkpoint(path: str | Path) -> Checkpoint:
    """One reader per checkpoint directory, shared by the layers that load from it."""
    return Checkpoint(Path(path).resolve())
