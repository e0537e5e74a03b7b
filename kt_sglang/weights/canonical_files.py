"""The canonical CPU weight format on disk (docs/weight-format.md).

A directory with ``kt_weights.json`` (the manifest) and the experts in one of two layouts:

- per layer: ``layer-{L:05d}.safetensors`` holding ``experts.{e}.{gate,up,down}.{weight,scales,mins|zeros}``
  (what the converter writes layer by layer, and keeps with ``--no-merge-safetensor``);
- merged: shards ``experts-{i:05d}-of-{n:05d}.safetensors`` of whole layers, tensors named
  ``layers.{L}.experts.{e}...``, and ``model.safetensors.index.json`` mapping each tensor to its
  shard. The index is written last: when it exists, the merge is complete.

Tensors are in the layout of ``kt_sglang.engine.canonical``, independent of ISA, tile layout and
NUMA count: the engine repacks at load. Files are written under a temporary name and renamed, so a
file that exists is complete.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kt_sglang.engine.canonical import CanonicalMatrix, canonical_layout
from kt_sglang.engine.methods import Method
from kt_sglang.weights import packed_files
from kt_sglang.weights.source import CANONICAL_FORMAT as FORMAT
from kt_sglang.weights.source import open_safetensors

VERSION = 1
MANIFEST = "kt_weights.json"
LAYOUTS = ("canonical", "packed")
PROJECTIONS = ("gate", "up", "down")
METADATA_KEY = "kt_sglang"
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 2 * 2**30  # whole layers per shard up to this size (the merge holds one shard in memory)


@dataclass
class Manifest:
    method: str
    group_size: int
    model_type: str
    num_layers: int
    moe_layers: list[int]
    num_experts: int
    hidden_size: int
    intermediate_size: int
    source_dtype: str
    source_config_sha256: str
    source_tensors_sha256: str
    # "canonical": safetensors files the engine repacks at load; "packed": the engine's own packed
    # layout, computed from the mapped files (weights/packed_files.py)
    layout: str = "canonical"
    format: str = FORMAT
    version: int = VERSION

    def write(self, directory: Path) -> None:
        tmp = directory / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, directory / MANIFEST)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """The manifest of a converted directory; ValueError naming the file when it cannot be."""
        path = Path(directory) / MANIFEST
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}): convert again") from exc
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds {type(data).__name__}, not a manifest object: convert again")
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(
                f"{path}: format {data.get('format')!r} v{data.get('version')} is not {FORMAT} v{VERSION}"
            )
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = sorted(required - set(data))
        unknown = sorted(set(data) - names)
        if missing or unknown:
            what = "; ".join(
                part
                for part in (
                    f"lacks {', '.join(missing)}" if missing else "",
                    f"has unknown {', '.join(unknown)}" if unknown else "",
                )
                if part
            )
            raise ValueError(f"{path} {what}: convert again")
        if data.get("layout", "canonical") not in LAYOUTS:
            raise ValueError(
                f"{path}: unknown layout {data['layout']!r} (this build reads {', '.join(LAYOUTS)})"
            )
        return cls(**data)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def layer_file(layer: int) -> str:
    return f"layer-{layer:05d}.safetensors"


def file_mode() -> int:
    """What the umask allows a new file (safetensors creates its files 0600 whatever the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _save_atomic(tensors: dict[str, torch.Tensor], final: Path, header: dict) -> None:
    # One metadata key: safetensors writes its metadata map in hash order, which changes from run
    # to run; a single sorted JSON string keeps reruns byte-identical.
    metadata = {METADATA_KEY: json.dumps(header, sort_keys=True)}
    tmp = final.with_name(final.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, file_mode())
        os.replace(tmp, final)
    except Exception as exc:  # disk full, permissions (safetensors raises its own error type)
        tmp.unlink(missing_ok=True)  # leave nothing that looks written
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        free = shutil.disk_usage(final.parent).free
        raise OSError(
            getattr(exc, "errno", None) or errno.EIO,
            f"writing {final} failed ({getattr(exc, 'strerror', None) or exc}); the file needs "
            f"{need / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free; rerun to resume",
        ) from None


def format_size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def expert_bytes(method: Method, group: int, H: int, I: int) -> int:
    """Bytes of one expert's three canonical matrices."""
    total = 0
    for N, K in ((I, H), (I, H), (H, I)):
        for shape, dtype in canonical_layout(method, group, N, K).values():
            total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return total


# safetensors writes each file as `.tmp` + 6 random characters beside it, then renames it: a run
# killed inside save_file leaves one behind.
_SAFETENSORS_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6,12}")


def clean_leftovers(directory: Path, manifest: Manifest) -> list[Path]:
    """Removes what an interrupted run left: temporary files (ours and safetensors'), and per-layer
    files already merged."""
    directory = Path(directory)
    removed = sorted(directory.glob("*.tmp"))
    removed += sorted(
        p for p in directory.glob(".tmp*") if _SAFETENSORS_TEMP.fullmatch(p.name) and p.is_file()
    )
    if read_index(directory) is not None and all(
        layer_is_complete(directory, manifest, layer) for layer in manifest.moe_layers
    ):
        removed += [
            directory / layer_file(la) for la in manifest.moe_layers if (directory / layer_file(la)).exists()
        ]
    for path in removed:
        path.unlink()
    return removed


def write_layer(
    directory: Path, manifest: Manifest, layer: int, experts: list[dict[str, CanonicalMatrix]]
) -> Path:
    """Writes one layer atomically (temporary name, then rename)."""
    tensors = {}
    for e, mats in enumerate(experts):
        for proj in PROJECTIONS:
            m = mats[proj]
            for part in ("weight", "scales", "mins", "zeros", "global_scale"):
                t = getattr(m, part)
                if t is not None:
                    tensors[f"experts.{e}.{proj}.{part}"] = t.contiguous()
    header = {
        "format": FORMAT,
        "version": VERSION,
        "method": manifest.method,
        "group_size": manifest.group_size,
        "layer": layer,
        "num_experts": len(experts),
    }
    final = directory / layer_file(layer)
    _save_atomic(tensors, final, header)
    return final


def read_index(directory: Path) -> dict[str, str] | None:
    """The merged layout's tensor -> shard map, None for the per-layer layout."""
    path = Path(directory) / INDEX
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["weight_map"]
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{path} is not a valid index ({exc}); delete it and rerun the converter") from None


def _first_tensor(layer: int) -> str:
    return f"layers.{layer}.experts.0.gate.weight"


def merge_layers(directory: Path, manifest: Manifest, shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Merges the per-layer files into shards of whole layers with an index, then removes them.

    Holds one shard in memory. Safe to interrupt: the per-layer files go only after the index is
    written, and a rerun merges again.
    """
    directory = Path(directory)
    if read_index(directory) is not None:
        return []
    missing = [layer for layer in manifest.moe_layers if not layer_is_complete(directory, manifest, layer)]
    if missing:
        raise ValueError(f"{directory}: layers {missing} are not converted yet; rerun without --resume-layer")
    groups: list[list[int]] = [[]]
    size = 0
    for layer in manifest.moe_layers:
        layer_bytes = (directory / layer_file(layer)).stat().st_size
        if groups[-1] and size + layer_bytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(layer)
        size += layer_bytes
    weight_map: dict[str, str] = {}
    shards = []
    total = 0
    for i, group in enumerate(groups, 1):
        shard = directory / f"experts-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for layer in group:
            with safe_open(str(directory / layer_file(layer)), framework="pt") as f:
                for name in f.keys():
                    tensors[f"layers.{layer}.{name}"] = f.get_tensor(name)
        header = {
            "format": FORMAT,
            "version": VERSION,
            "method": manifest.method,
            "group_size": manifest.group_size,
            "layers": group,
            "num_experts": manifest.num_experts,
        }
        _save_atomic(tensors, shard, header)
        weight_map.update({name: shard.name for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        shards.append(shard)
        del tensors
    index = {
        "metadata": {"format": FORMAT, "version": VERSION, "total_size": total},
        "weight_map": weight_map,
    }
    tmp = directory / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True))
    os.replace(tmp, directory / INDEX)
    for layer in manifest.moe_layers:
        (directory / layer_file(layer)).unlink()
    return shards


def verify_files(directory: Path, manifest: Manifest) -> None:
    """Every shard or layer file the directory needs exists and opens (a truncated file does not);
    ValueError naming the file."""
    directory = Path(directory)
    if manifest.layout == "packed":
        for layer in manifest.moe_layers:
            packed_files.check_layer_file(
                directory / packed_files.packed_file(layer),
                manifest.method,
                manifest.group_size,
                layer,
                manifest.num_experts,
            )
        return
    index = read_index(directory)
    names = (
        sorted(set(index.values())) if index is not None else [layer_file(la) for la in manifest.moe_layers]
    )
    for name in names:
        path = directory / name
        if not path.is_file():
            raise ValueError(
                f"{path} is missing: the conversion did not finish (rerun kt-sglang convert-cpu)"
            )
        with open_safetensors(path, "convert again"):
            pass


def layer_is_complete(directory: Path, manifest: Manifest, layer: int) -> bool:
    """True when the layer is in the merged index, or its file exists, opens, and carries the
    manifest's method, group and experts."""
    if manifest.layout == "packed":
        path = Path(directory) / packed_files.packed_file(layer)
        try:
            packed_files.check_layer_file(
                path, manifest.method, manifest.group_size, layer, manifest.num_experts
            )
        except ValueError:  # missing, damaged or another conversion's: it will be written again
            return False
        return True
    index = read_index(directory)
    if index is not None:
        shard = index.get(_first_tensor(layer))
        return shard is not None and (Path(directory) / shard).is_file()
    path = directory / layer_file(layer)
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(METADATA_KEY, "{}"))
            names = set(f.keys())
    except Exception:  # unreadable or truncated: not complete, it will be written again
        return False
    parts = len(canonical_layout(Method(manifest.method), manifest.group_size, 1, 1))
    return (
        meta.get("method") == manifest.method
        and meta.get("group_size") == manifest.group_size
        and meta.get("layer") == layer
        and len(names) == manifest.num_experts * 3 * parts
    )


def read_layer(
    directory: Path, manifest: Manifest, layer: int, experts: list[int]
) -> dict[str, list[CanonicalMatrix]]:
    """The canonical matrices of the given experts, checked against the manifest's shapes."""
    directory = Path(directory)
    if layer not in manifest.moe_layers:
        raise ValueError(
            f"layer {layer} is not an MoE layer of {directory} (MoE layers: {manifest.moe_layers})"
        )
    index = read_index(directory)
    if index is not None:
        if _first_tensor(layer) not in index:
            raise ValueError(f"{directory / INDEX} does not list layer {layer}: convert again")
        path, prefix = directory / index[_first_tensor(layer)], f"layers.{layer}."
    else:
        path, prefix = directory / layer_file(layer), ""
    if not path.is_file():
        raise ValueError(f"{path} is missing: the conversion did not finish (rerun kt-sglang convert-cpu)")
    method = Method(manifest.method)
    H, I = manifest.hidden_size, manifest.intermediate_size
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    out: dict[str, list[CanonicalMatrix]] = {p: [] for p in PROJECTIONS}
    with open_safetensors(path, "convert again") as f:
        names = set(f.keys())
        for e in experts:
            for proj in PROJECTIONS:
                layout = canonical_layout(method, manifest.group_size, *shapes[proj])
                parts = {}
                for part, (shape, dtype) in layout.items():
                    name = f"{prefix}experts.{e}.{proj}.{part}"
                    if name not in names:
                        raise ValueError(f"{path.name}: tensor {name} is missing")
                    t = f.get_tensor(name)
                    if tuple(t.shape) != shape or t.dtype != dtype:
                        found = f"{t.dtype} {list(t.shape)}"
                        raise ValueError(f"{path.name}: {name} is {found}; expected {dtype} {list(shape)}")
                    parts[part] = t
                out[proj].append(CanonicalMatrix(**parts))
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        torch.float8_e4m3fn: "fp8",
    }.get(dtype, str(dtype))
