"""A Hugging Face model directory as users have it: config.json, one or many safetensors shards.

Tensors are read lazily through safetensors' memory-mapped access: only the experts of the layer
being loaded are ever materialized.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kt_sglang.weights.families import ModelFamily, family_for

# Name prefixes of the text model inside multimodal checkpoints, tried in order.
_PREFIXES = ("", "language_model.", "model.language_model.")


class CheckpointError(ValueError):
    """The checkpoint does not hold what the model needs; the message names file and tensor."""


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
        self._files = self._index_tensors()
        self._handles: dict[Path, object] = {}
        self.spec = self._read_spec()

    # ------------------------------------------------------------------------------------------

    def _index_tensors(self) -> dict[str, Path]:
        index_path = self.path / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map", {})
            files = {name: self.path / shard for name, shard in weight_map.items()}
            for shard in sorted(set(files.values())):
                if not shard.is_file():
                    raise CheckpointError(
                        f"{index_path.name} names shard {shard.name}, which is missing from {self.path}"
                    )
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.path} holds no *.safetensors files")
        files = {}
        for shard in shards:
            for name in self._open(shard).keys():
                files[name] = shard
        return files

    def _open(self, shard: Path):
        handle = self._handles.get(shard) if hasattr(self, "_handles") else None
        if handle is None:
            try:
                handle = safe_open(str(shard), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for truncated files
                raise CheckpointError(f"cannot read {shard} (truncated or not safetensors): {exc}") from exc
            if hasattr(self, "_handles"):
                self._handles[shard] = handle
        return handle

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

    # ------------------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self._files

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise CheckpointError(f"tensor {name} is not in the checkpoint {self.path}")
        shard = self._files[name]
        try:
            return self._open(shard).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {name} from {shard.name}: {exc}") from exc

    def _resolve(self, pattern: str, **kw) -> str | None:
        for prefix in _PREFIXES:
            name = prefix + pattern.format(**kw)
            if prefix == "model.language_model." and name.startswith("model.language_model.model."):
                name = name.replace("model.language_model.model.", "model.language_model.", 1)
            if name in self._files:
                return name
        return None

    def _dense(self, name: str) -> torch.Tensor:
        """A weight as bf16/fp16/fp32; FP8 e4m3 is dequantized with its weight_scale_inv blocks."""
        w = self.tensor(name)
        if w.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return w
        if w.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"tensor {name} has dtype {w.dtype}; expected bf16, fp16, fp32 or fp8 e4m3")
        scale_name = name + "_scale_inv"
        if scale_name not in self._files:
            raise CheckpointError(f"tensor {name} is FP8 but {scale_name} is missing")
        block = self.quantization.get("weight_block_size")
        if not block:
            raise CheckpointError(
                f"tensor {name} is FP8 but config.json has no quantization_config.weight_block_size"
            )
        scale = self.tensor(scale_name).float()
        bn, bk = int(block[0]), int(block[1])
        N, K = w.shape
        expected = (-(-N // bn), -(-K // bk))
        if tuple(scale.shape) != expected:
            raise CheckpointError(
                f"{scale_name} has shape {list(scale.shape)}; expected {list(expected)} for {bn}x{bk} blocks"
            )
        full = scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
        return (w.float() * full).bfloat16()

    def layer_experts(
        self, layer: int, experts: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up ``[n, I, H]`` and down ``[n, H, I]`` of the given experts (all by default)."""
        spec, fam = self.spec, self.family
        if layer not in spec.moe_layers:
            raise CheckpointError(
                f"layer {layer} is not an MoE layer of {self.path.name} (MoE layers: {list(spec.moe_layers)})"
            )
        ids = list(range(spec.num_experts)) if experts is None else list(experts)
        I, H = spec.intermediate_size, spec.hidden_size
        if fam.experts and self._resolve(fam.experts["gate"], layer=layer, expert=ids[0] if ids else 0):
            parts = [
                self._expert_stack(fam.experts[proj], layer, ids, shape)
                for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))
            ]
            dtype = _common_dtype(parts)
            return tuple(p.to(dtype).contiguous() for p in parts)
        return self._fused_experts(layer, ids)

    def iter_experts(self, layer: int):
        """Yields (gate [I, H], up [I, H], down [H, I]) expert by expert: the converter's streaming read,
        which never holds a whole layer of per-expert checkpoints in memory."""
        spec, fam = self.spec, self.family
        I, H = spec.intermediate_size, spec.hidden_size
        if not (fam.experts and self._resolve(fam.experts["gate"], layer=layer, expert=0)):
            gate, up, down = self.layer_experts(layer)  # fused: the layer is one tensor anyway
            yield from zip(gate, up, down, strict=True)
            return
        if layer not in spec.moe_layers:
            self.layer_experts(layer, [])  # raises the error naming the MoE layers
        for e in range(spec.num_experts):
            yield tuple(
                self._expert_stack(fam.experts[proj], layer, [e], shape)[0]
                for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))
            )

    def _expert_stack(self, pattern: str, layer: int, ids: list[int], shape: tuple[int, int]) -> torch.Tensor:
        mats = []
        for e in ids:
            name = self._resolve(pattern, layer=layer, expert=e)
            if name is None:
                missing = pattern.format(layer=layer, expert=e)
                raise CheckpointError(f"expert tensor {missing} is missing from {self.path}")
            w = self._dense(name)
            if tuple(w.shape) != shape:
                found = list(w.shape)
                raise CheckpointError(
                    f"{name} in {self._files[name].name} has shape {found}; expected {list(shape)}"
                )
            mats.append(w)
        return torch.stack(mats) if mats else torch.empty(0, *shape)

    def expert_tensor_names(self) -> list[str]:
        """Names of every expert tensor in the checkpoint (records which checkpoint a conversion used)."""
        return sorted(name for name in self._files if ".experts." in name)

    def expert_dtype(self, layer: int) -> torch.dtype:
        """The stored dtype of the layer's expert weights (before any dequantization)."""
        fam = self.family
        name = self._resolve(fam.experts["gate"], layer=layer, expert=0) if fam.experts else None
        name = name or self._resolve(fam.fused_experts.get("gate_up", ""), layer=layer)
        if name is None:
            raise CheckpointError(f"layer {layer}: no expert tensors in {self.path}")
        return self.tensor(name).dtype  # memory-mapped: reading one tensor's dtype is cheap

    def _fused_experts(self, layer: int, ids: list[int]):
        fam, spec = self.family, self.spec
        I, H, E = spec.intermediate_size, spec.hidden_size, spec.num_experts
        names = {k: self._resolve(p, layer=layer) for k, p in fam.fused_experts.items()}
        if not all(names.values()):
            pattern = fam.experts.get("gate", "").format(layer=layer, expert=0)
            raise CheckpointError(
                f"layer {layer}: no expert tensors ({pattern} or fused gate_up_proj) in {self.path}"
            )
        gate_up = self._dense_stack(names["gate_up"])
        down = self._dense_stack(names["down"])
        # Both orientations exist: [E, 2I, H] (linear layout) and [E, H, 2I]; the linear one wins a tie.
        if tuple(gate_up.shape) == (E, 2 * I, H):
            gate, up = gate_up[:, :I], gate_up[:, I:]
        elif tuple(gate_up.shape) == (E, H, 2 * I):
            gate, up = gate_up[:, :, :I].transpose(1, 2), gate_up[:, :, I:].transpose(1, 2)
        else:
            found = list(gate_up.shape)
            expected = f"[{E}, {2 * I}, {H}] or [{E}, {H}, {2 * I}]"
            raise CheckpointError(f"{names['gate_up']} has shape {found}; expected {expected}")
        if tuple(down.shape) == (E, H, I):
            pass
        elif tuple(down.shape) == (E, I, H):
            down = down.transpose(1, 2)
        else:
            raise CheckpointError(
                f"{names['down']} has shape {list(down.shape)}; expected [{E}, {H}, {I}] or [{E}, {I}, {H}]"
            )
        return tuple(t[ids].contiguous() for t in (gate, up, down))

    def _dense_stack(self, name: str) -> torch.Tensor:
        w = self.tensor(name)
        if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CheckpointError(
                f"fused expert tensor {name} has dtype {w.dtype}; expected bf16, fp16 or fp32"
            )
        return w


def _common_dtype(tensors) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


@functools.lru_cache(maxsize=4)
def open_checkpoint(path: str | Path) -> Checkpoint:
    """One reader per checkpoint directory, shared by the layers that load from it."""
    return Checkpoint(Path(path).resolve())
