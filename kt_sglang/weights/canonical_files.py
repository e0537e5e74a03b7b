"""The canonical CPU weight format on disk (docs/weight-format.md).

A directory with ``kt_weights.json`` (the manifest) and one safetensors file per MoE layer,
``layer-{L:05d}.safetensors``, holding ``experts.{e}.{gate,up,down}.{weight,scales,mins}`` in the
layout of ``kt_sglang.engine.canonical``. Independent of ISA, tile layout and NUMA count: the engine
repacks at load. Files are written under a temporary name and renamed, so a file that exists is
complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kt_sglang.engine.canonical import CanonicalMatrix, canonical_layout
from kt_sglang.engine.methods import Method

FORMAT = "kt-sglang-experts"
VERSION = 1
MANIFEST = "kt_weights.json"
PROJECTIONS = ("gate", "up", "down")
METADATA_KEY = "kt_sglang"


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
    format: str = FORMAT
    version: int = VERSION

    def write(self, directory: Path) -> None:
        tmp = directory / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, directory / MANIFEST)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(
                f"{path}: format {data.get('format')!r} v{data.get('version')} is not {FORMAT} v{VERSION}"
            )
        return cls(**data)


def is_canonical_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def layer_file(layer: int) -> str:
    return f"layer-{layer:05d}.safetensors"


def write_layer(
    directory: Path, manifest: Manifest, layer: int, experts: list[dict[str, CanonicalMatrix]]
) -> Path:
    """Writes one layer atomically (temporary name, then rename)."""
    tensors = {}
    for e, mats in enumerate(experts):
        for proj in PROJECTIONS:
            m = mats[proj]
            for part in ("weight", "scales", "mins"):
                t = getattr(m, part)
                if t is not None:
                    tensors[f"experts.{e}.{proj}.{part}"] = t.contiguous()
    # One metadata key: safetensors writes its metadata map in hash order, which changes from run
    # to run; a single sorted JSON string keeps reruns byte-identical.
    header = {
        "format": FORMAT,
        "version": VERSION,
        "method": manifest.method,
        "group_size": manifest.group_size,
        "layer": layer,
        "num_experts": len(experts),
    }
    metadata = {METADATA_KEY: json.dumps(header, sort_keys=True)}
    final = directory / layer_file(layer)
    tmp = directory / (layer_file(layer) + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, final)
    except OSError as exc:  # disk full, permissions: leave nothing that looks written
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"writing {final} failed ({exc.strerror or exc}); rerun to resume") from exc
    return final


def layer_is_complete(directory: Path, manifest: Manifest, layer: int) -> bool:
    """True when the layer's file exists, opens, and carries the manifest's method, group and experts."""
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
    path = Path(directory) / layer_file(layer)
    if layer not in manifest.moe_layers:
        raise ValueError(
            f"layer {layer} is not an MoE layer of {directory} (MoE layers: {manifest.moe_layers})"
        )
    if not path.is_file():
        raise ValueError(f"{path} is missing: the conversion did not finish (rerun kt-sglang convert-cpu)")
    method = Method(manifest.method)
    H, I = manifest.hidden_size, manifest.intermediate_size
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    out: dict[str, list[CanonicalMatrix]] = {p: [] for p in PROJECTIONS}
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for e in experts:
            for proj in PROJECTIONS:
                layout = canonical_layout(method, manifest.group_size, *shapes[proj])
                parts = {}
                for part, (shape, dtype) in layout.items():
                    name = f"experts.{e}.{proj}.{part}"
                    if name not in names:
                        raise ValueError(f"{path.name}: tensor {name} is missing")
                    t = f.get_tensor(name)
                    if tuple(t.shape) != shape or t.dtype != dtype:
                        found = f"{t.dtype} {list(t.shape)}"
                        raise ValueError(f"{path.name}: {name} is {found}; expected {dtype} {list(shape)}")
                    parts[part] = t
                out[proj].append(CanonicalMatrix(parts["weight"], parts.get("scales"), parts.get("mins")))
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        torch.float8_e4m3fn: "fp8",
    }.get(dtype, str(dtype))
