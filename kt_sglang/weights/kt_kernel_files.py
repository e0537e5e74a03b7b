"""kt-kernel's converted expert directories, read as they are.

kt-kernel (0.7.x) writes its AMX-packed experts in two layouts, one per NUMA part ``P`` (its
``threadpool_count``; part ``p`` holds intermediate rows ``p*I/P ..`` of gate/up and the same
columns of down):

- raw (``AMXMoEWrapper(..., cpu_save=True)``):
  ``_layer_{L}/_numa_{P}/{INT8|INT4}_{gate|up|down}_{E}_{bytes}Byte_{quant|scale}_.kt``;
- safetensors (its ``convert_cpu_weights.py``):
  ``blk.{L}.ffn_{gate|up|down}_exps.{E}.numa.{P}.{weight|scale}``, beside the model's other
  tensors and its ``config.json``.

Both hold the same bytes: a matrix ``[n, k]`` of kt-kernel's ``BufferB`` (int8, or int4 two to a
byte) in its tile order, then one float32 scale per row over the whole of k (INT8: w = d * q, q in
-127..127; INT4: w = 16 * d * q, q in -7..7). The tile order: blocks of ``N_BLOCK`` rows (64 INT8,
128 INT4), within them blocks of ``K_BLOCK`` bytes of k (3584 INT8, 1792 INT4), within those 32-row
by 64-byte tiles whose two 16-row halves are stored transposed as 16 x 16 four-byte words (the VNNI
order AMX loads). An INT4 byte holds k-value ``j`` of its 128-value step in the low nibble and
``j + 64`` in the high one.

The experts become the engine's canonical matrices (engine/canonical.py) of the same method: INT8
as ``AMXINT8`` and INT4 as ``AMXINT4`` (u = q + 8, scale 16 d, min -8 * scale), each row's one scale
written to every group of the row; the values are kt-kernel's, the scale rounded to fp16. A layer is
read a few experts at a time: nothing but the engine's packed copy stays in memory.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kt_sglang.engine.canonical import CanonicalMatrix
from kt_sglang.engine.native import _native
from kt_sglang.weights.source import CheckpointError, TensorSource, unreadable

PROJECTIONS = ("gate", "up", "down")

# kt-kernel's type name in raw file names -> (engine method, bits per weight, N_BLOCK, K_BLOCK bytes)
TYPES = {"INT8": ("AMXINT8", 8, 64, 3584), "INT4": ("AMXINT4", 4, 128, 1792)}

_RAW_LAYER = re.compile(r"^_layer_(\d+)$")
_RAW_PART = re.compile(r"^_numa_(\d+)$")
_RAW_FILE = re.compile(r"^(\w+?)_(gate|up|down)_(\d+)_(\d+)Byte_(quant|scale)_\.kt$")
_KEY = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(\d+)\.numa\.(\d+)\.(weight|scale)$")


def looks_like_kt_kernel(path: Path) -> bool:
    """Whether ``path`` is a directory kt-kernel wrote (either layout), by its names only."""
    if not path.is_dir():
        return False
    if any(_RAW_LAYER.match(p.name) for p in path.iterdir() if p.is_dir()):
        return True
    try:
        source = TensorSource(path)
    except CheckpointError:
        return False
    return any(_KEY.match(name) for name in source.names())


def read_tiles(raw: np.ndarray, out: torch.Tensor, type_name: str) -> None:
    """One stored matrix (bytes in kt-kernel's tile order) -> ``out``, its canonical ``[n, kb]``
    bytes in the engine method's order (INT4: nibbles reordered and offset; kt_kernel_layout.cpp)."""
    _, _, row_block, k_block = TYPES[type_name]
    n, kb = out.shape
    _native.read_kt_kernel_tiles(
        raw.ctypes.data,
        raw.nbytes,
        out.data_ptr(),
        out.numel(),
        n,
        kb,
        row_block,
        k_block,
        type_name == "INT4",
    )


@dataclass(frozen=True)
class MatrixSpec:
    """One projection's stored shape in one NUMA part."""

    n: int
    k: int
    bits: int

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * self.bits // 8

    @property
    def scale_bytes(self) -> int:
        return 4 * self.n


class KtKernelDir:
    """One kt-kernel directory: which layers, experts and NUMA parts it holds, and their bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._raw = any(_RAW_LAYER.match(p.name) for p in self.path.iterdir() if p.is_dir())
        # (layer, projection, expert, part) -> (weight location, scale location)
        self._files: dict[tuple[int, str, int, int], list] = {}
        self.type_name: str | None = None  # "INT8" / "INT4"; known from raw names, else from sizes
        if self._raw:
            self._index_raw()
        else:
            self._tensors = TensorSource(self.path)
            self._index_safetensors()
        if not self._files:
            raise CheckpointError(f"{self.path} holds no kt-kernel experts")
        self.layers = sorted({key[0] for key in self._files})

    @property
    def layout(self) -> str:
        return "raw .kt files" if self._raw else "safetensors"

    def _index_raw(self) -> None:
        for layer_dir in sorted(self.path.iterdir()):
            m = _RAW_LAYER.match(layer_dir.name)
            if not m or not layer_dir.is_dir():
                continue
            for part_dir in sorted(layer_dir.iterdir()):
                pm = _RAW_PART.match(part_dir.name)
                if not pm:
                    continue
                for f in part_dir.iterdir():
                    fm = _RAW_FILE.match(f.name)
                    if not fm:
                        continue
                    type_name, proj, expert, size, kind = fm.groups()
                    if type_name not in TYPES:
                        raise CheckpointError(
                            f"{f}: kt-kernel's {type_name} experts are not a layout kt-sglang reads "
                            f"(it reads {', '.join(TYPES)}: AMXINT8 / AMXINT4); point --kt-weight-path at "
                            "the model's checkpoint"
                        )
                    if self.type_name not in (None, type_name):
                        raise CheckpointError(
                            f"{f} is {type_name}, other files of {self.path} are {self.type_name}: "
                            "a directory holds one kt-kernel method"
                        )
                    self.type_name = type_name
                    slot = self._files.setdefault((int(m[1]), proj, int(expert), int(pm[1])), [None, None])
                    slot[kind == "scale"] = (f, int(size))

    def _index_safetensors(self) -> None:
        for name in self._tensors.names():
            m = _KEY.match(name)
            if m:
                layer, proj, expert, part, kind = m.groups()
                slot = self._files.setdefault((int(layer), proj, int(expert), int(part)), [None, None])
                slot[kind == "scale"] = name

    def parts(self, layer: int) -> int:
        """The layer's NUMA part count (checked to be 0..P-1 for every expert and projection)."""
        found = {key[3] for key in self._files if key[0] == layer}
        if not found:
            raise CheckpointError(
                f"{self.path} holds no experts of layer {layer} (it has layers {self.layers})"
            )
        return max(found) + 1

    def experts(self, layer: int) -> int:
        return max(key[2] for key in self._files if key[0] == layer) + 1

    def sizes(self) -> tuple[int, int, int]:
        """(experts, hidden_size, moe_intermediate_size) as the first layer's files give them: one
        float32 scale per stored row (gate: a part's intermediate rows; down: hidden rows)."""
        layer = self.layers[0]
        P = self.parts(layer)
        rows = []
        for proj in ("gate", "down"):
            scale = self._files.get((layer, proj, 0, 0), [None, None])[1]
            if scale is None:
                raise CheckpointError(f"{self._where(layer, proj, 0, 0, 1)} is missing")
            rows.append(self._size(scale) // 4)
        return self.experts(layer), rows[1], rows[0] * P

    def method(self) -> str:
        """The engine method of the stored type (AMXINT8 / AMXINT4)."""
        experts, hidden, intermediate = self.sizes()
        self._infer_type(self.layers[0], hidden, intermediate, self.parts(self.layers[0]))
        return TYPES[self.type_name][0]

    def _where(self, layer: int, proj: str, expert: int, part: int, kind: int) -> str:
        if self._raw:
            base = self.path / f"_layer_{layer}" / f"_numa_{part}"
            what = "scale" if kind else "quant"
            return f"{base}/{self.type_name or 'INT?'}_{proj}_{expert}_*Byte_{what}_.kt"
        name = f"blk.{layer}.ffn_{proj}_exps.{expert}.numa.{part}.{'scale' if kind else 'weight'}"
        return self._tensors.where(name)

    def _size(self, location) -> int:
        if self._raw:
            return location[1]
        rows = self._tensors.rows(location)
        itemsize = self._tensors.dtype(location).itemsize
        return math.prod(rows.get_shape()) * itemsize

    def check_layer(self, layer: int, hidden: int, intermediate: int, num_experts: int, method: str) -> None:
        """Every expert, projection and part of the layer present, of the sizes the shapes give, in
        ``method``'s type; the error names the first file that is not."""
        P = self.parts(layer)
        experts = self.experts(layer)
        if experts != num_experts:
            raise CheckpointError(
                f"{self.path}: layer {layer} holds {experts} experts; the model has {num_experts}"
            )
        if intermediate % P:
            raise CheckpointError(
                f"{self.path}: layer {layer} is split into {P} NUMA parts, which do not divide "
                f"moe_intermediate_size {intermediate}"
            )
        self._infer_type(layer, hidden, intermediate, P)
        if TYPES[self.type_name][0] != method:
            raise CheckpointError(
                f"{self.path} holds kt-kernel {self.type_name} experts ({TYPES[self.type_name][0]}); "
                f"--kt-method is {method}"
            )
        for proj in PROJECTIONS:
            spec = self.spec(proj, hidden, intermediate, P)
            for expert in range(num_experts):
                for part in range(P):
                    slot = self._files.get((layer, proj, expert, part), [None, None])
                    for kind, want in ((0, spec.weight_bytes), (1, spec.scale_bytes)):
                        if slot[kind] is None:
                            raise CheckpointError(
                                f"{self._where(layer, proj, expert, part, kind)} is missing"
                            )
                        size = self._size(slot[kind])
                        if size != want:
                            raise CheckpointError(
                                f"{self._where(layer, proj, expert, part, kind)} holds {size} bytes; a "
                                f"{spec.n} x {spec.k} {self.type_name} part needs {want}"
                            )
                        if self._raw:
                            reason = unreadable(slot[kind][0])
                            if reason is None and slot[kind][0].stat().st_size != size:
                                reason = (
                                    f"it holds {slot[kind][0].stat().st_size} bytes, its name says {size}"
                                )
                            if reason is not None:
                                raise CheckpointError(f"cannot read {slot[kind][0]}: {reason}")

    def _infer_type(self, layer: int, hidden: int, intermediate: int, parts: int) -> None:
        """Safetensors name no type: INT8 or INT4 is what a gate part's size says."""
        if self.type_name is not None:
            return
        gate = self._files.get((layer, "gate", 0, 0), [None, None])[0]
        if gate is None:
            raise CheckpointError(f"{self._where(layer, 'gate', 0, 0, 0)} is missing")
        size = self._size(gate)
        self.type_name = {8.0: "INT8", 4.0: "INT4"}.get(size * 8 / (intermediate // parts * hidden))
        if self.type_name is None:
            raise CheckpointError(
                f"{self._where(layer, 'gate', 0, 0, 0)} holds {size} bytes: neither INT8 nor INT4 of a "
                f"{intermediate // parts} x {hidden} matrix (is hidden_size right?)"
            )

    def spec(self, proj: str, hidden: int, intermediate: int, parts: int) -> MatrixSpec:
        bits = TYPES[self.type_name][1]
        part = intermediate // parts
        return MatrixSpec(part, hidden, bits) if proj != "down" else MatrixSpec(hidden, part, bits)

    def _bytes(self, location, dtype: np.dtype) -> np.ndarray:
        if self._raw:
            return np.fromfile(location[0], dtype=dtype)
        return self._tensors.tensor(location).contiguous().view(torch.uint8).numpy().view(dtype)

    def read(
        self, layer: int, proj: str, experts: list[int], hidden: int, intermediate: int, group: int
    ) -> list[CanonicalMatrix]:
        """The experts' matrices of one projection, parts joined, as canonical matrices of the
        method with ``group`` (which divides every part's k)."""
        P = self.parts(layer)
        self._infer_type(layer, hidden, intermediate, P)
        spec = self.spec(proj, hidden, intermediate, P)
        kb = spec.k * spec.bits // 8
        # gate/up parts are rows, read in place; down parts are columns, joined after
        rows = spec.n * P if proj != "down" else spec.n
        q = torch.empty(len(experts), rows, kb * (P if proj == "down" else 1), dtype=torch.uint8)
        part_out = q if proj != "down" else torch.empty(len(experts), spec.n, kb, dtype=torch.uint8)
        scales = []
        for part in range(P):
            slots = [self._files[(layer, proj, e, part)] for e in experts]
            for i, slot in enumerate(slots):
                out = q[i, part * spec.n : (part + 1) * spec.n] if proj != "down" else part_out[i]
                read_tiles(self._bytes(slot[0], np.uint8), out, self.type_name)
            if proj == "down":
                q[:, :, part * kb : (part + 1) * kb] = part_out
            scales.append(torch.from_numpy(np.stack([self._bytes(s[1], np.float32) for s in slots])))
        if spec.bits == 8:
            q = q.view(torch.int8)
        groups_per_part = spec.k // group
        if proj != "down":
            row_scales = torch.cat(scales, dim=1)[:, :, None].expand(-1, -1, groups_per_part)
        else:  # a down row has one scale per part: each covers that part's groups
            row_scales = torch.stack(scales, dim=2).repeat_interleave(groups_per_part, dim=2)
        if spec.bits == 8:
            fp16 = row_scales.to(torch.float16).contiguous()
            return [CanonicalMatrix(q[i].contiguous(), fp16[i]) for i in range(len(experts))]
        fp16 = (row_scales * 16).to(torch.float16).contiguous()
        mins = (fp16.float() * -8).to(torch.float16)
        return [
            CanonicalMatrix(q[i].contiguous(), fp16[i], mins[i].contiguous()) for i in range(len(experts))
        ]


def whole_row_group(method_groups: tuple[int, ...], hidden: int, part_k: int) -> int:
    """The largest group the method allows that divides both k's (gate/up: hidden; down: a NUMA
    part's intermediate slice): every group of a row then carries the row's one scale."""
    for g in sorted(method_groups, reverse=True):
        if hidden % g == 0 and part_k % g == 0:
            return g
    raise CheckpointError(
        f"no group of {list(method_groups)} divides hidden_size {hidden} and the NUMA part's "
        f"intermediate slice {part_k}"
    )
