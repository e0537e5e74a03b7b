"""Converted layers in the engine's packed layout (`kt-sglang convert-cpu --layout packed`).

One file per MoE layer, ``layer-{L:05d}.ktpack``: the magic ``KTSGPACK``, the header's length
(uint64, little endian), a JSON header, then from page-aligned offsets every expert's gate/up and
every expert's down projection exactly as one pool of the engine holds them (`MoeLayer` in
native/include/kt/moe_layer.h, "packed file layout"). The layout is the same on every ISA, so a
file serves AVX2, AVX-512 and AMX alike; it depends on the method, group and shapes only, and its
version changes with the packed layout. A layer whose engine runs one pool computes from the
memory-mapped file itself: no copy, and a restart reads from the page cache.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kt_sglang.engine.native import _native
from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.base import BaseMoEWrapper

MAGIC = b"KTSGPACK"
FORMAT = "kt-sglang-packed"
ALIGN = 4096  # data offsets: page boundaries
_PREFIX = struct.Struct("<8sQ")
_MAX_HEADER = 1 << 20


def packed_file(layer: int) -> str:
    return f"layer-{layer:05d}.ktpack"


@dataclass(frozen=True)
class PackedHeader:
    method: str
    group_size: int
    down_method: str
    down_group: int
    hidden_size: int
    intermediate_size: int
    layer: int
    num_experts: int
    gate_up_bytes: int  # per expert
    down_bytes: int
    gate_up_offset: int
    down_offset: int
    format: str = FORMAT
    version: int = _native.packed_file_version


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def header_for(wrapper: BaseMoEWrapper, layer: int, num_experts: int) -> PackedHeader:
    """The header of a file holding ``num_experts`` experts as ``wrapper``'s layer packs them."""
    gu, dn = wrapper.packed_file_bytes()
    probe = PackedHeader(
        wrapper.method.value,
        wrapper.group_size,
        wrapper.down_method.value,
        wrapper.down_group_size,
        wrapper.hidden_size,
        wrapper.moe_intermediate_size,
        layer,
        num_experts,
        gu,
        dn,
        0,
        0,
    )
    gate_up_offset = _align(_PREFIX.size + len(_header_bytes(probe)) + 64)  # room for larger offsets
    down_offset = _align(gate_up_offset + num_experts * gu)
    return PackedHeader(**{**asdict(probe), "gate_up_offset": gate_up_offset, "down_offset": down_offset})


def _header_bytes(h: PackedHeader) -> bytes:
    return json.dumps(asdict(h), sort_keys=True).encode()


def write_packed_layer(wrapper: BaseMoEWrapper, path: Path, layer: int) -> int:
    """Writes every expert of ``wrapper`` (which holds them all) to ``path`` atomically (a temporary
    name, then a rename, so a file that exists is complete). Returns the bytes written."""
    E = wrapper.num_experts
    h = header_for(wrapper, layer, E)
    head = _header_bytes(h)
    gate_up, down = np.empty(h.gate_up_bytes, np.uint8), np.empty(h.down_bytes, np.uint8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, len(head)) + head)
            f.truncate(h.down_offset + E * h.down_bytes)  # the padding between sections reads as zeros
            for e in range(E):
                wrapper.export_packed(e, gate_up, down)
                os.pwrite(f.fileno(), gate_up.data, h.gate_up_offset + e * h.gate_up_bytes)
                os.pwrite(f.fileno(), down.data, h.down_offset + e * h.down_bytes)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno or errno.EIO, f"writing {path} failed: {exc.strerror or exc}") from None
    return h.down_offset + E * h.down_bytes


def read_header(path: Path) -> PackedHeader:
    """The header of a packed layer file; CheckpointError naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
                raise CheckpointError(f"{path} is not a kt-sglang packed layer (no {MAGIC.decode()} magic)")
            (length,) = struct.unpack("<Q", prefix[8:])
            if length > _MAX_HEADER:
                raise CheckpointError(
                    f"{path}: header of {length} bytes; the file is damaged (convert again)"
                )
            text = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
        header = PackedHeader(**data)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable header ({exc}); convert again") from None
    if header.format != FORMAT or header.version != _native.packed_file_version:
        raise CheckpointError(
            f"{path}: packed layout {header.format} v{header.version}; this build reads {FORMAT} "
            f"v{_native.packed_file_version} (convert again)"
        )
    return header


def map_packed_layer(wrapper: BaseMoEWrapper, path: Path, h: PackedHeader, slot_to_source: list[int]) -> None:
    """Gives ``wrapper``'s held slots the experts of the file ``h`` heads (check_layer_file's: this
    layer's, complete), slot e expert ``slot_to_source[e]``."""
    ours = header_for(wrapper, h.layer, h.num_experts)
    for field in ("method", "group_size", "down_method", "down_group", "hidden_size", "intermediate_size"):
        if getattr(h, field) != getattr(ours, field):
            raise CheckpointError(
                f"{path}: written with {field} {getattr(h, field)}; this layer has {getattr(ours, field)}"
            )
    # same method, group and shapes, so a different size per expert means another layout
    if (h.gate_up_bytes, h.down_bytes) != (ours.gate_up_bytes, ours.down_bytes):
        raise CheckpointError(
            f"{path}: {h.gate_up_bytes} + {h.down_bytes} bytes an expert; this build packs "
            f"{ours.gate_up_bytes} + {ours.down_bytes} (convert again)"
        )
    try:
        wrapper.map_packed(str(path), h.gate_up_offset, h.down_offset, h.num_experts, slot_to_source)
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(str(exc)) from None


def layer_bytes(h: PackedHeader) -> int:
    return h.down_offset + h.num_experts * h.down_bytes


def check_layer_file(path: Path, method: str, group_size: int, layer: int, num_experts: int) -> PackedHeader:
    """The header of a complete packed file of this layer (a converted directory's); CheckpointError
    naming the file otherwise."""
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the conversion did not finish (rerun kt-sglang convert-cpu)"
        )
    h = read_header(path)
    found = (h.method, h.group_size, h.layer, h.num_experts)
    if found != (method, group_size, layer, num_experts):
        raise CheckpointError(
            f"{path} holds layer {h.layer} of {h.num_experts} experts in {h.method} group {h.group_size}; "
            f"expected layer {layer} of {num_experts} in {method} group {group_size} (convert again)"
        )
    size = path.stat().st_size
    if size != layer_bytes(h):
        raise CheckpointError(f"{path} is {size} bytes; its header says {layer_bytes(h)} (convert again)")
    return h
