"""A GGUF model as llama.cpp's converters write it: one ``.gguf`` file or a split set
(``<name>-00001-of-0000N.gguf``), read with the ``gguf`` package's reader (memory-mapped: only the
experts of the layer being loaded are ever read).

``--kt-method LLAMAFILE --kt-weight-path <file or directory>`` serves the routed experts of such a
model as they ship: each expert tensor (``blk.N.ffn_{gate,up,down}_exps.weight``, or a fused
``ffn_gate_up_exps``) is computed in its own GGUF type through the engine method that type maps onto
(``gguf_blocks``). The shapes come from the layer (the model's ``config.json``, through SGLang), and
the file's metadata must agree with them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from kt_sglang.engine.activation import SILU, Glu
from kt_sglang.engine.canonical import CanonicalMatrix
from kt_sglang.engine.weight_source import ModelShape
from kt_sglang.weights.gguf_blocks import BLOCK_TYPES, BlockType
from kt_sglang.weights.source import CheckpointError, unreadable

GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# How llama.cpp names a MoE layer's routed experts: [E, N, K] tensors, K contiguous.
_EXPERTS = {"gate": "blk.{layer}.ffn_gate_exps.weight", "up": "blk.{layer}.ffn_up_exps.weight"}
_DOWN = "blk.{layer}.ffn_down_exps.weight"
_GATE_UP = "blk.{layer}.ffn_gate_up_exps.weight"  # gate rows, then up rows
# The experts' activation by GGUF architecture, as llama.cpp computes it (its graph fixes gpt-oss's
# alpha and clamp); SiLU for the others.
_ACTIVATIONS = {"gpt-oss": Glu("swiglu_oai", 7.0, 1.702)}


def _gguf_files(path: Path) -> list[Path]:
    """The files of the model at ``path``: the file itself with its split siblings, or the one model
    a directory holds."""
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if not files:
            raise CheckpointError(f"{path} holds no .gguf files")
        firsts = [f for f in files if not _SPLIT.match(f.name) or _SPLIT.match(f.name)["index"] == "00001"]
        if len(firsts) != 1:
            raise CheckpointError(
                f"{path} holds {len(firsts)} GGUF models ({', '.join(f.name for f in firsts)}); point "
                "--kt-weight-path at the .gguf file (the first of a split set) to serve"
            )
        first = firsts[0]
    else:
        first = path
        if (reason := unreadable(first)) is not None:
            raise CheckpointError(f"cannot read {first}: {reason}")
    split = _SPLIT.match(first.name)
    if split is None:
        return [first]
    count = int(split["count"])
    files = [first.with_name(f"{split['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    if missing := [f.name for f in files if not f.exists()]:
        raise CheckpointError(
            f"{first.name} is split in {count} files; missing beside it: {', '.join(missing)}"
        )
    return files


def _open(path: Path) -> GGUFReader:
    if (reason := unreadable(path)) is not None:
        raise CheckpointError(f"cannot read {path}: {reason}")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise CheckpointError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OverflowError) as exc:  # the reader's errors on a cut file
        raise CheckpointError(
            f"cannot read {path}: truncated or damaged GGUF ({path.stat().st_size} bytes; {exc})"
        ) from None


@dataclass(frozen=True)
class ExpertTensor:
    """One expert tensor of a layer: ``[E, N, K]`` in GGUF type ``qtype``, rows of ``row_bytes``."""

    name: str
    file: Path
    qtype: GGMLQuantizationType
    experts: int
    rows: int  # N
    cols: int  # K
    data: np.ndarray  # uint8 [E, N, row_bytes], memory-mapped

    def block_type(self) -> BlockType:
        found = BLOCK_TYPES.get(self.qtype)
        if found is None:
            names = ", ".join(t.name for t in BLOCK_TYPES)
            raise CheckpointError(
                f"tensor {self.name} in {self.file.name} is GGUF type {self.qtype.name}, which the CPU "
                f"engine does not compute; it computes {names}"
            )
        return found


class GgufModel:
    """The tensors and metadata of one GGUF model (all its split files)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files = _gguf_files(self.path)
        self._readers = [_open(f) for f in self.files]
        self._tensors = {
            t.name: (f, t) for f, r in zip(self.files, self._readers, strict=True) for t in r.tensors
        }
        self.architecture = self.metadata("general.architecture")
        if self.architecture is None:
            raise CheckpointError(f"{self.files[0]} has no general.architecture: not a llama.cpp model file")

    def metadata(self, key: str):
        """A metadata value of the first file (strings decoded, arrays as lists); None when absent."""
        field = self._readers[0].get_field(key)
        if field is None:
            return None
        if field.types[0] == GGUFValueType.STRING:
            return bytes(field.parts[-1]).decode("utf-8")
        if field.types[0] == GGUFValueType.ARRAY:
            return [field.parts[i].tolist()[0] for i in field.data]
        return field.parts[-1].tolist()[0]

    def arch_value(self, key: str):
        """``{architecture}.{key}``, e.g. ``expert_count``."""
        return self.metadata(f"{self.architecture}.{key}")

    def activation(self) -> Glu:
        """The experts' activation, as llama.cpp computes this architecture's."""
        return _ACTIVATIONS.get(self.architecture, SILU)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> ExpertTensor:
        file, t = self._tensors[name]
        dims = [int(d) for d in t.shape]  # ne0 (K), ne1 (N), ne2 (E)
        if len(dims) != 3:
            raise CheckpointError(f"tensor {name} in {file.name} has shape {dims}; expected [K, N, experts]")
        K, N, E = dims
        data = t.data.view(np.uint8).reshape(E, N, -1)
        return ExpertTensor(name, file, GGMLQuantizationType(t.tensor_type), E, N, K, data)

    def expert_layers(self) -> list[int]:
        """The layers holding routed experts."""
        found = re.compile(r"^blk\.(\d+)\.ffn_down_exps\.weight$")
        return sorted(int(m[1]) for name in self._tensors if (m := found.match(name)))

    def shape(self) -> ModelShape:
        """The MoE shape the expert tensors have (those of the first layer that holds some)."""
        layers = self.expert_layers()
        if not layers:
            raise CheckpointError(f"{self.files[0]} holds no routed experts (no {_DOWN.format(layer='N')})")
        down = self.tensor(_DOWN.format(layer=layers[0]))  # [E, H, I]
        return ModelShape(down.experts, down.rows, down.cols, tuple(layers), str(self.files[0]))

    def layer_experts(self, layer: int) -> dict[str, tuple[ExpertTensor, int]]:
        """gate, up, down: each projection's tensor and the first of its rows."""
        down = _DOWN.format(layer=layer)
        if not self.has(down):
            raise CheckpointError(
                f"{self.files[0]} has no {down}: layer {layer} holds no routed experts "
                f"(layers that do: {self.expert_layers()})"
            )
        if self.has(fused := _GATE_UP.format(layer=layer)):
            gate_up = self.tensor(fused)
            half = gate_up.rows // 2
            return {"gate": (gate_up, 0), "up": (gate_up, half), "down": (self.tensor(down), 0)}
        parts = {}
        for proj, pattern in _EXPERTS.items():
            name = pattern.format(layer=layer)
            if not self.has(name):
                raise CheckpointError(f"{self.files[0]} has {down} but no {name}")
            parts[proj] = (self.tensor(name), 0)
        return {**parts, "down": (self.tensor(down), 0)}

    def check_layer(
        self, layer: int, num_experts: int, hidden: int, intermediate: int
    ) -> dict[str, BlockType]:
        """Each projection's block type, after checking the layer's tensors against the model's shapes
        (the layer's ``num_experts``, ``hidden_size``, ``moe_intermediate_size``)."""
        stated = {
            "expert_count": num_experts,
            "embedding_length": hidden,
            "expert_feed_forward_length": intermediate,
        }
        for key, ours in stated.items():
            theirs = self.arch_value(key)
            if isinstance(theirs, list):  # per layer (llama.cpp reads some keys as arrays)
                theirs = theirs[layer] if layer < len(theirs) else None
            if theirs is not None and int(theirs) != ours:
                raise CheckpointError(
                    f"{self.files[0]}: {self.architecture}.{key} is {theirs}; the model's config gives {ours}"
                )
        expected = {
            "gate": (intermediate, hidden),
            "up": (intermediate, hidden),
            "down": (hidden, intermediate),
        }
        types = {}
        for proj, (t, _) in self.layer_experts(layer).items():
            rows = t.rows // 2 if t.name.endswith("gate_up_exps.weight") else t.rows
            got = (rows, t.cols)
            if t.experts != num_experts or got != expected[proj]:
                raise CheckpointError(
                    f"tensor {t.name} in {t.file.name} holds {t.experts} experts of [{got[0]}, {got[1]}] "
                    f"(N, K); the model's config gives {num_experts} experts of "
                    f"[{expected[proj][0]}, {expected[proj][1]}] for {proj} (num_experts, hidden_size, "
                    "moe_intermediate_size)"
                )
            block, _ = GGML_QUANT_SIZES[t.qtype]
            if t.cols % block:
                raise CheckpointError(
                    f"tensor {t.name}: K={t.cols} is not a multiple of its block of {block}"
                )
            types[proj] = t.block_type()
        return types

    def layer_methods(
        self, layer: int, num_experts: int, hidden: int, intermediate: int
    ) -> tuple[tuple[str, int], tuple[str, int]]:
        """The engine method and group of the layer's gate/up, and of its down projection (checked as
        ``check_layer``)."""
        types = self.check_layer(layer, num_experts, hidden, intermediate)
        gate, up, down = ((t.method, t.group) for t in types.values())
        if gate != up:
            parts = self.layer_experts(layer)
            raise CheckpointError(
                f"layer {layer} of {self.files[0].name} stores gate in {parts['gate'][0].qtype.name} "
                f"({gate[0]}) and up in {parts['up'][0].qtype.name} ({up[0]}); the engine computes them "
                "together, in one method"
            )
        return gate, down

    def read_biases(self, layer: int, experts: list[int]) -> tuple[np.ndarray | None, ...]:
        """gate, up ``[n, I]`` and down ``[n, H]`` float32 biases of ``experts`` (gpt-oss's
        ``blk.N.ffn_*_exps.bias``); None where the model has none."""
        out = []
        for proj in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{proj}_exps.bias"
            if not self.has(name):
                out.append(None)
                continue
            file, t = self._tensors[name]
            if GGMLQuantizationType(t.tensor_type) != GGMLQuantizationType.F32 or len(t.shape) != 2:
                raise CheckpointError(
                    f"tensor {name} in {file.name} is {GGMLQuantizationType(t.tensor_type).name} of "
                    f"{[int(d) for d in t.shape]}; expected F32 [N, experts]"
                )
            out.append(np.asarray(t.data, dtype=np.float32)[experts])
        return tuple(out)

    def read_experts(self, layer: int, experts: list[int]) -> tuple[list[CanonicalMatrix], ...]:
        """gate, up, down canonical matrices of ``experts``, each in its GGUF type's engine method."""
        out: tuple[list[CanonicalMatrix], ...] = ([], [], [])
        parts = self.layer_experts(layer)
        for i, proj in enumerate(("gate", "up", "down")):
            t, first = parts[proj]
            rows = t.rows // 2 if t.name.endswith("gate_up_exps.weight") else t.rows
            transcode = t.block_type().transcode
            for e in experts:
                out[i].append(transcode(np.asarray(t.data[e, first : first + rows]), t.cols))
        return out


@functools.lru_cache(maxsize=4)
def open_gguf(path: str | Path) -> GgufModel:
    """One reader per GGUF model, shared by the layers that load from it."""
    return GgufModel(Path(path).resolve())
