"""A Hugging Face model directory as users have it: config.json, one or many safetensors shards.

Tensors are read lazily through safetensors' memory-mapped access: only the experts of the layer
being loaded are ever materialized.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kt_sglang.weights import int4_checkpoint, mxfp4_checkpoint, nvfp4_checkpoint
from kt_sglang.weights.families import ModelFamily, family_for
from kt_sglang.weights.source import CheckpointError, open_safetensors, unreadable

# The format name in the manifest, shards and index that `kt-sglang convert-cpu` writes (canonical_files).
CANONICAL_FORMAT = "kt-sglang-experts"

if TYPE_CHECKING:  # imported where used: reading a checkpoint needs no native engine
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.engine.methods import Method

# Name prefixes of the text model inside multimodal checkpoints, tried in order.
_PREFIXES = ("", "language_model.", "model.language_model.")

# Block size of FP8 checkpoints that do not say (DeepSeek-V3, Qwen3-FP8, MiniMax-M2 all use 128 x 128).
FP8_BLOCK = 128


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
        self._files = self._index_tensors()
        self._handles: dict[Path, object] = {}
        self.spec = self._read_spec()

    # ------------------------------------------------------------------------------------------

    def _index_tensors(self) -> dict[str, Path]:
        index_path = self.path / "model.safetensors.index.json"
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text())
                weight_map = index["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_path} is not a valid safetensors index ({exc})") from None
            if (index.get("metadata") or {}).get("format") == CANONICAL_FORMAT:
                raise CheckpointError(
                    f"{index_path} was written by kt-sglang convert-cpu, not with this model: its "
                    "experts were converted into the model's own directory. Delete that index and the "
                    "experts-*.safetensors shards, and convert again into a directory of its own"
                )
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

    def verify_files(self) -> None:
        """Opens every shard (headers only): a truncated file is named now, not at first use."""
        for shard in sorted(set(self._files.values())):
            self._open(shard)

    def _open(self, shard: Path):
        handle = self._handles.get(shard) if hasattr(self, "_handles") else None
        if handle is None:
            handle = open_safetensors(shard)
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

    def resolve(self, pattern: str, **kw) -> str | None:
        for prefix in _PREFIXES:
            name = prefix + pattern.format(**kw)
            if prefix == "model.language_model." and name.startswith("model.language_model.model."):
                name = name.replace("model.language_model.model.", "model.language_model.", 1)
            if name in self._files:
                return name
        return None

    def where(self, name: str) -> str:
        return f"{name} in {self._files[name].name}" if name in self._files else name

    def _config_block(self) -> tuple[int, int]:
        block = self.quantization.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK]
        return int(block[0]), int(block[1])

    def _dense(self, name: str) -> torch.Tensor:
        """A weight as bf16/fp16/fp32; FP8 e4m3 is dequantized with its block or channel scales."""
        w = self.tensor(name)
        if w.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return w
        if mxfp4_checkpoint.is_packed(self, name):  # e2m1 codes: their values in fp32
            from kt_sglang.engine.canonical import dequantize
            from kt_sglang.engine.methods import method_for_format

            N, K = w.shape[0], 2 * w.shape[1]
            method = method_for_format(mxfp4_checkpoint.FORMAT)
            return dequantize(method, mxfp4_checkpoint.read_expert(self, name, (N, K)), K)
        if not is_float8(w.dtype):
            raise CheckpointError(
                f"tensor {self.where(name)} has dtype {w.dtype}; expected bf16, fp16, fp32 or fp8 e4m3"
            )
        bn, bk = self._config_block()
        scale_name, kind = self._fp8_scale_name(name, w)
        scales = self._fp8_scales(name, w, scale_name, kind, (bn, bk))
        N, K = w.shape
        if kind == "channel":
            full = scales[:, None]
        else:
            full = scales.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
        return (w.float() * full).bfloat16()

    def _fp8_scale_name(self, name: str, w: torch.Tensor) -> tuple[str, str]:
        """The scales of an FP8 weight and their kind: "block" (``{name}_scale_inv``, DeepSeek-V3's
        naming, or a ``{name}_scale`` of the block shape) or "channel" (any other ``{name}_scale``)."""
        if w.dtype != torch.float8_e4m3fn:
            raise CheckpointError(
                f"tensor {self.where(name)} has dtype {w.dtype}; FP8 weights must be float8_e4m3fn "
                "(e4m3fnuz and e5m2 are not read as they are: convert the checkpoint to float8_e4m3fn "
                "or bf16 first)"
            )
        if w.dim() != 2:
            raise CheckpointError(f"tensor {self.where(name)} has shape {list(w.shape)}; expected 2-D")
        inv, channel = name + "_scale_inv", name + "_scale"
        if inv in self._files:
            return inv, "block"
        if channel in self._files:  # compressed-tensors names both kinds so: the shape tells
            (N, K), (bn, bk) = w.shape, self._config_block()
            blocks = (-(-N // bn), -(-K // bk))
            return channel, "block" if tuple(self.tensor(channel).shape) == blocks != (N, 1) else "channel"
        raise CheckpointError(
            f"tensor {name} is FP8 but {inv} is missing, and so is a per-channel {channel} "
            f"(the weight is in {self._files[name].name}, {self.path})"
        )

    def _fp8_scales(self, name: str, w: torch.Tensor, scale_name: str, kind: str, block) -> torch.Tensor:
        """The scales as fp32, unchanged in value: ``[ceil(N/bn), ceil(K/bk)]`` for blocks, ``[N]`` for
        channels (from ``[N]`` or ``[N, 1]``; one per-tensor scale is repeated over the channels)."""
        N, K = w.shape
        bn, bk = block
        scale = self.tensor(scale_name)
        where = self.where(scale_name)
        if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(
                f"scales {where} have dtype {scale.dtype}; expected float32, bfloat16 or float16"
            )
        if kind == "block":
            expected = (-(-N // bn), -(-K // bk))
            if tuple(scale.shape) != expected:
                raise CheckpointError(
                    f"scales {where} have shape {list(scale.shape)}; expected {list(expected)} "
                    f"(one per {bn} x {bk} block of the [{N}, {K}] weight {name})"
                )
            scales = scale.float().contiguous()
        elif tuple(scale.shape) in ((N,), (N, 1)):
            scales = scale.float().reshape(N).contiguous()
        elif scale.numel() == 1 and scale.dim() <= 1:  # one scale for the whole tensor
            scales = scale.float().reshape(1).expand(N).contiguous()
        else:
            raise CheckpointError(
                f"scales {where} have shape {list(scale.shape)}; expected [{N}] or [{N}, 1] "
                f"(one per output channel of the [{N}, {K}] weight {name})"
            )
        if not bool(torch.isfinite(scales).all()):
            raise CheckpointError(f"scales {where} hold NaN or infinite values")
        return scales

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
        if fam.fused_mxfp4:
            from kt_sglang.engine.canonical import dequantize
            from kt_sglang.engine.methods import method_for_format

            mats = mxfp4_checkpoint.read_fused_layer(self, layer, ids)
            mxfp4 = method_for_format(mxfp4_checkpoint.FORMAT)
            return tuple(
                torch.stack([dequantize(mxfp4, m, K) for m in proj]) if proj else torch.empty(0, N, K)
                for proj, (N, K) in zip(mats, ((I, H), (I, H), (H, I)), strict=True)
            )
        if self._per_expert(layer, ids[0] if ids else 0):
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
        if not self._per_expert(layer):
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

    def _per_expert(self, layer: int, expert: int = 0) -> bool:
        """Whether the layer's experts are stored one tensor (or one INT4 set) per expert."""
        gate = self.family.experts.get("gate")
        if not gate:
            return False
        return bool(
            self.resolve(gate, layer=layer, expert=expert)
            or int4_checkpoint.base_name(self, gate, layer=layer, expert=expert)
            or nvfp4_checkpoint.base_name(self, gate, layer=layer, expert=expert)
        )

    def _expert_stack(self, pattern: str, layer: int, ids: list[int], shape: tuple[int, int]) -> torch.Tensor:
        mats = []
        for e in ids:
            nv = nvfp4_checkpoint.base_name(self, pattern, layer=layer, expert=e)
            if nv is not None:  # NVFP4 read by a method that quantizes: its values in fp32
                from kt_sglang.engine.canonical import dequantize
                from kt_sglang.engine.methods import method_for_format

                method = method_for_format(nvfp4_checkpoint.FORMAT)
                mats.append(dequantize(method, nvfp4_checkpoint.read_expert(self, nv, shape), shape[1]))
                continue
            name = self.resolve(pattern, layer=layer, expert=e)
            base = None if name else int4_checkpoint.base_name(self, pattern, layer=layer, expert=e)
            if base is not None:  # an INT4 checkpoint read by a method that quantizes: its values in fp32
                fmt = int4_checkpoint.detect_format(self, base + ".weight")
                scheme = int4_checkpoint.read_scheme(self, fmt, base)
                matrix = int4_checkpoint.read_matrix(self, base, scheme, shape)
                mats.append(int4_checkpoint.dequantize(matrix, scheme, shape[1]))
                continue
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

    # ------------------------------------------------------------------------------------------
    # FP8 experts as the checkpoint ships them (methods whose canonical weight is e4m3)

    def _fp8_kind(self, method: Method) -> tuple[str, int]:
        """("block", block size) or ("channel", 0) for a method storing e4m3 weights."""
        from kt_sglang.engine.methods import METHODS

        info = METHODS[method]
        if info.tensors[0].dtype != torch.float8_e4m3fn or len(info.tensors) < 2:
            raise ValueError(f"{method.value} does not store float8_e4m3fn weights")
        if info.tensors[1].shape == "N":
            return "channel", 0
        return "block", info.default_group

    def _check_fp8_config(self, method: Method) -> None:
        kind, block = self._fp8_kind(method)
        found = self.quantization.get("weight_block_size")
        if kind == "block" and found is not None and [int(v) for v in found] != [block, block]:
            raise CheckpointError(
                f"{self.path / 'config.json'}: quantization_config.weight_block_size is {list(found)}; "
                f"{method.value}'s blocks are {block} x {block} (a method that quantizes reads this "
                "checkpoint: it dequantizes it first)"
            )

    def _fp8_matrix(
        self, pattern: str, layer: int, expert: int, shape: tuple[int, int], method: Method
    ) -> CanonicalMatrix:
        from kt_sglang.engine.canonical import CanonicalMatrix
        from kt_sglang.engine.methods import METHODS

        name = self.resolve(pattern, layer=layer, expert=expert)
        if name is None:
            missing = pattern.format(layer=layer, expert=expert)
            raise CheckpointError(f"expert tensor {missing} is missing from {self.path}")
        kind, block = self._fp8_kind(method)
        w = self.tensor(name)
        if tuple(w.shape) != shape:
            raise CheckpointError(f"{self.where(name)} has shape {list(w.shape)}; expected {list(shape)}")
        scale_name, found = self._fp8_scale_name(name, w)
        if found != kind:
            fits = [m.value for m in METHODS if self._fp8_kind_or_none(m) == found]
            what = "one scale per output channel" if found == "channel" else "block scales"
            raise CheckpointError(
                f"{self.where(name)} is FP8 with {what} ({scale_name}); {method.value} needs "
                f"{'per-channel' if kind == 'channel' else 'block'} scales: use "
                f"{' or '.join(fits) or 'a method that quantizes'} for this checkpoint"
            )
        scales = self._fp8_scales(name, w, scale_name, kind, (block, block))  # block: unused for channels
        return CanonicalMatrix(w, scales)

    def _fp8_kind_or_none(self, method: Method) -> str | None:
        try:
            return self._fp8_kind(method)[0]
        except ValueError:
            return None

    def _fp8_expert(
        self, layer: int, expert: int, method: Method
    ) -> tuple[CanonicalMatrix, CanonicalMatrix, CanonicalMatrix]:
        fam, spec = self.family, self.spec
        I, H = spec.intermediate_size, spec.hidden_size
        return tuple(
            self._fp8_matrix(fam.experts[proj], layer, expert, shape, method)
            for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))
        )

    def _check_fp8_layer(self, layer: int, method: Method) -> None:
        spec, fam = self.spec, self.family
        if layer not in spec.moe_layers:
            raise CheckpointError(
                f"layer {layer} is not an MoE layer of {self.path.name} (MoE layers: {list(spec.moe_layers)})"
            )
        if not self._per_expert(layer):
            raise CheckpointError(
                f"layer {layer}: {method.value} reads per-expert FP8 tensors "
                f"({fam.experts.get('gate', '').format(layer=layer, expert=0)} and its scales); "
                f"{self.path} has none"
            )
        self._check_fp8_config(method)

    def layer_fp8_experts(
        self, layer: int, experts: list[int], method: Method
    ) -> tuple[list[CanonicalMatrix], list[CanonicalMatrix], list[CanonicalMatrix]]:
        """gate, up, down canonical matrices (``CanonicalMatrix(weight e4m3 [N, K], scales fp32)``) of
        the given experts, for a method whose canonical weight is float8_e4m3fn: the checkpoint's
        values as they are (bf16/fp16 scales become fp32, exactly)."""
        self._check_fp8_layer(layer, method)
        gate, up, down = [], [], []
        for e in experts:
            g, u, d = self._fp8_expert(layer, e, method)
            gate.append(g)
            up.append(u)
            down.append(d)
        return gate, up, down

    def iter_fp8_experts(self, layer: int, method: Method):
        """Yields (gate, up, down) canonical FP8 matrices expert by expert (the converter's stream)."""
        self._check_fp8_layer(layer, method)
        for e in range(self.spec.num_experts):
            yield self._fp8_expert(layer, e, method)

    def expert_tensor_names(self) -> list[str]:
        """Names of every expert tensor in the checkpoint (records which checkpoint a conversion used)."""
        return sorted(name for name in self._files if ".experts." in name)

    def expert_dtype(self, layer: int) -> torch.dtype:
        """The stored dtype of the layer's expert weights (before any dequantization; int32 for the
        packed INT4 formats)."""
        fam = self.family
        name = self.resolve(fam.experts["gate"], layer=layer, expert=0) if fam.experts else None
        nv = fam.experts and nvfp4_checkpoint.base_name(self, fam.experts["gate"], layer=layer, expert=0)
        if nv:
            name = nv + (".weight" if self.has(nv + ".weight") else ".weight_packed")
        if name is None and fam.experts:
            base = int4_checkpoint.base_name(self, fam.experts["gate"], layer=layer, expert=0)
            fmt = base and int4_checkpoint.detect_format(self, base + ".weight")
            name = fmt and f"{base}.{int4_checkpoint.packed_suffix(fmt)}"
        name = name or self.resolve(fam.fused_experts.get("gate_up", ""), layer=layer)
        if name is None and fam.fused_mxfp4:
            name = self.resolve(fam.fused_mxfp4["gate_up"] + "_blocks", layer=layer)
        if name is None:
            raise CheckpointError(f"layer {layer}: no expert tensors in {self.path}")
        return self.tensor(name).dtype  # memory-mapped: reading one tensor's dtype is cheap

    def expert_format(self, layer: int) -> str:
        """How the layer's experts are stored: "dense" (bf16/fp16/fp32), "fp8", "mxfp4", or an INT4
        format ("pack-quantized", "gptq"), as MethodInfo.checkpoint_format names them."""
        fam = self.family
        if fam.fused_mxfp4:
            return mxfp4_checkpoint.FORMAT
        if fam.experts and nvfp4_checkpoint.base_name(self, fam.experts["gate"], layer=layer, expert=0):
            return nvfp4_checkpoint.FORMAT
        base = fam.experts and int4_checkpoint.base_name(self, fam.experts["gate"], layer=layer, expert=0)
        if base:
            return int4_checkpoint.detect_format(self, base + ".weight")
        gate = fam.experts and self.resolve(fam.experts["gate"], layer=layer, expert=0)
        if gate and mxfp4_checkpoint.is_packed(self, gate):
            return mxfp4_checkpoint.FORMAT
        return "fp8" if is_float8(self.expert_dtype(layer)) else "dense"

    def activation(self):
        """The experts' activation (kt_sglang.engine.activation.Glu), from the family and config."""
        return self.family.glu(self.config)

    def layer_biases(self, layer: int, experts: list[int]):
        """gate, up ``[n, I]`` and down ``[n, H]`` fp32 biases of the given experts (gpt-oss); None
        where the model has none."""
        if not self.family.fused_mxfp4:
            return None, None, None
        return mxfp4_checkpoint.read_fused_biases(self, layer, experts)

    def layer_native_experts(
        self, layer: int, experts: list[int], method: Method
    ) -> tuple[list[CanonicalMatrix], list[CanonicalMatrix], list[CanonicalMatrix]]:
        """gate, up, down canonical matrices of the given experts for a method that takes this
        checkpoint's values as they are (``MethodInfo.checkpoint_format``)."""
        if self._checkpoint_format(method) == "fp8":
            return self.layer_fp8_experts(layer, experts, method)
        if self._checkpoint_format(method) == mxfp4_checkpoint.FORMAT and self.family.fused_mxfp4:
            self._check_native_format(layer, method)
            return mxfp4_checkpoint.read_fused_layer(self, layer, experts)
        read = self._int4_reader(layer, method)
        gate, up, down = [], [], []
        for e in experts:
            for out, m in zip((gate, up, down), read(e), strict=True):
                out.append(m)
        return gate, up, down

    def iter_native_experts(self, layer: int, method: Method):
        """Yields (gate, up, down) canonical matrices expert by expert (the converter's stream)."""
        if self._checkpoint_format(method) == "fp8":
            yield from self.iter_fp8_experts(layer, method)
            return
        if self._checkpoint_format(method) == mxfp4_checkpoint.FORMAT and self.family.fused_mxfp4:
            self._check_native_format(layer, method)
            experts = list(range(self.spec.num_experts))
            yield from zip(*mxfp4_checkpoint.read_fused_layer(self, layer, experts), strict=True)
            return
        read = self._int4_reader(layer, method)
        for e in range(self.spec.num_experts):
            yield read(e)

    def _checkpoint_format(self, method: Method) -> str:
        from kt_sglang.engine.methods import METHODS

        fmt = METHODS[method].checkpoint_format
        if fmt is None:
            raise ValueError(f"{method.value} quantizes dense weights; it reads no checkpoint format as is")
        return fmt

    def _check_native_format(self, layer: int, method: Method) -> str:
        """The method's checkpoint format, after checking that the layer's experts are stored so."""
        from kt_sglang.engine.methods import METHODS

        fmt = self._checkpoint_format(method)
        spec = self.spec
        if layer not in spec.moe_layers:
            raise CheckpointError(
                f"layer {layer} is not an MoE layer of {self.path.name} (MoE layers: {list(spec.moe_layers)})"
            )
        per_expert = self._per_expert(layer) or self.family.fused_mxfp4
        found = self.expert_format(layer) if per_expert else "fused dense"
        if found != fmt:
            fits = [m.value for m, i in METHODS.items() if i.checkpoint_format == found]
            quantizing = ", ".join(m.value for m, i in METHODS.items() if i.quantizes_dense)
            raise CheckpointError(
                f"layer {layer} of {self.path}: {method.value} reads {fmt} experts, and these are "
                f"{found}; use {' or '.join(fits) or 'a method that quantizes (' + quantizing + ')'}"
            )
        return fmt

    def _int4_reader(self, layer: int, method: Method):
        """A function expert -> (gate, up, down) canonical matrices of a per-expert INT4, MXFP4 or
        NVFP4 checkpoint's layer, after checking the layer, the format and the config's scheme once."""
        fmt = self._check_native_format(layer, method)
        spec, fam = self.spec, self.family
        I, H = spec.intermediate_size, spec.hidden_size
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        # Per format: where one linear's tensors are (its name or name prefix) and how it is read.
        if fmt == nvfp4_checkpoint.FORMAT:
            locate = functools.partial(nvfp4_checkpoint.base_name, self)
            read_one = functools.partial(nvfp4_checkpoint.read_expert, self)
        elif fmt == mxfp4_checkpoint.FORMAT:
            locate = self.resolve
            read_one = functools.partial(mxfp4_checkpoint.read_expert, self)
        else:
            locate = functools.partial(int4_checkpoint.base_name, self)
            scheme = int4_checkpoint.read_scheme(
                self, fmt, locate(fam.experts["gate"], layer=layer, expert=0)
            )

            def read_one(base, shape):
                return int4_checkpoint.read_matrix(self, base, scheme, shape)

        def read(e: int):
            mats = []
            for proj, shape in shapes.items():
                where = locate(fam.experts[proj], layer=layer, expert=e)
                if where is None:
                    missing = fam.experts[proj].format(layer=layer, expert=e)
                    raise CheckpointError(f"{fmt} tensors of {missing} are missing from {self.path}")
                mats.append(read_one(where, shape))
            return tuple(mats)

        return read

    def int4_group(self, layer: int, method: Method) -> int:
        """The group size of an INT4 checkpoint's experts, as its config states it."""
        fmt = self._checkpoint_format(method)
        first = int4_checkpoint.base_name(self, self.family.experts.get("gate", ""), layer=layer, expert=0)
        if first is None:
            raise CheckpointError(f"layer {layer} of {self.path} has no {fmt} experts")
        return int4_checkpoint.read_scheme(self, fmt, first).group

    def _fused_experts(self, layer: int, ids: list[int]):
        fam, spec = self.family, self.spec
        I, H = spec.intermediate_size, spec.hidden_size
        names = {k: self.resolve(p, layer=layer) for k, p in fam.fused_experts.items()}
        if not all(names.values()):
            pattern = fam.experts.get("gate", "").format(layer=layer, expert=0)
            raise CheckpointError(
                f"layer {layer}: no expert tensors ({pattern} or fused gate_up_proj) in {self.path}"
            )
        gate_up = self._fused_stack(names["gate_up"], "gate_up", 2 * I, H, ids)
        down = self._fused_stack(names["down"], "down", H, I, ids)
        return gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous(), down.contiguous()

    def _fused_stack(self, name: str, proj: str, out: int, inp: int, ids: list[int]) -> torch.Tensor:
        """Experts ``ids`` of a fused expert tensor as ``[n, out, in]``, read in the orientation its
        family declares (the shape alone cannot tell the two apart when ``hidden_size == 2 *
        moe_intermediate_size``). Only their rows are read: a loader that takes a layer a few
        experts at a time never holds the whole tensor."""
        fam, E = self.family, self.spec.num_experts
        rows = self._open(self._files[name]).get_slice(name)
        shape, dtype = list(rows.get_shape()), rows.get_dtype()
        if dtype not in ("BF16", "F16", "F32"):
            raise CheckpointError(
                f"fused expert tensor {self.where(name)} has dtype {dtype}; expected bf16, fp16 or fp32"
            )
        transposed = fam.fused_transposed(proj)
        expected = [E, inp, out] if transposed else [E, out, inp]
        if shape != expected:
            other = " (the other orientation)" if shape == [E, *expected[:0:-1]] else ""
            raise CheckpointError(
                f"fused expert tensor {self.where(name)} has shape {shape}{other}; expected "
                f"{expected} ({fam.fused_layout[proj]}: the layout configs/models/{fam.family}.json "
                f"declares for model_type {self.config.get('model_type')!r}; E, H, I from config.json)"
            )
        runs, start = [], 0  # contiguous runs of ids, one read each
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                runs.append(rows[ids[start] : ids[i - 1] + 1])
                start = i
        w = torch.cat(runs) if runs else torch.empty(0, *expected[1:], dtype=torch.bfloat16)
        return w.transpose(1, 2) if transposed else w


def is_float8(dtype: torch.dtype) -> bool:
    """Any 8-bit float (e4m3fn, e4m3fnuz, e5m2, ...): the checkpoint ships FP8 experts."""
    return dtype.is_floating_point and dtype.itemsize == 1


def _common_dtype(tensors) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


@functools.lru_cache(maxsize=4)
def open_checkpoint(path: str | Path) -> Checkpoint:
    """One reader per checkpoint directory, shared by the layers that load from it."""
    return Checkpoint(Path(path).resolve())
