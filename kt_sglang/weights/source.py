"""The tensors of a checkpoint's safetensors files, by name, and the error a file that does not hold
what the model needs raises.

`TensorSource` indexes a directory's shards (through ``model.safetensors.index.json`` or by opening
each ``*.safetensors``), keeps each shard open, and reads tensors lazily through safetensors'
memory-mapped access: only what a reader asks for is ever materialized.

A file that cannot be opened is named with the reason the OS gives (missing, permission denied, a
directory) before safetensors is asked: its own error for an unreadable file says "No such file or
directory" whatever the cause.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import torch
from safetensors import safe_open

from kt_sglang.engine.weight_source import WeightSourceError

# The format name in the manifest, shards and index that `kt-sglang convert-cpu` writes (canonical_files).
CANONICAL_FORMAT = "kt-sglang-experts"

# Name prefixes of the text model inside multimodal checkpoints, tried in order.
_PREFIXES = ("", "language_model.", "model.language_model.")

# safetensors' dtype names (a tensor's header) -> torch: a dtype is known without reading the tensor.
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": getattr(torch, "float4_e2m1fn_x2", None),
}


class CheckpointError(WeightSourceError):
    """The checkpoint does not hold what the model needs; the message names file and tensor."""


def unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read, in words; None when it can."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except FileNotFoundError:
        return "it is missing"
    except IsADirectoryError:
        return "it is a directory"
    except PermissionError:
        st = path.stat()
        return (
            f"permission denied (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}; "
            f"this process runs as uid {os.geteuid()})"
        )
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def open_safetensors(path: Path, advice: str = ""):
    """safetensors' handle of ``path``; a CheckpointError saying why it cannot be read, then
    ``advice`` (e.g. "convert again")."""
    tail = f": {advice}" if advice else ""
    reason = unreadable(path)
    if reason is not None:
        raise CheckpointError(f"cannot read {path}: {reason}{tail}")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for truncated files
        raise CheckpointError(f"cannot read {path} (truncated or not safetensors: {exc}){tail}") from None


class TensorSource:
    """The tensors of a Hugging Face model directory's safetensors shards, by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handles: dict[Path, object] = {}
        self._files = self._index()

    def _index(self) -> dict[str, Path]:
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

    def _open(self, shard: Path):
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = open_safetensors(shard)
        return handle

    def verify_files(self) -> None:
        """Opens every shard (headers only): a truncated file is named now, not at first use."""
        for shard in sorted(set(self._files.values())):
            self._open(shard)

    def names(self) -> list[str]:
        return list(self._files)

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

    def shard(self, name: str) -> Path:
        return self._files[name]

    def rows(self, name: str):
        """safetensors' lazy slice of a tensor: its shape and dtype name, and rows read on indexing."""
        return self._open(self._files[name]).get_slice(name)

    def dtype(self, name: str) -> torch.dtype:
        """A tensor's dtype, from its shard's header where safetensors names one torch knows."""
        found = _DTYPES.get(self.rows(name).get_dtype())
        return found if found is not None else self.tensor(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.rows(name).get_shape())

    def resolve(self, pattern: str, **kw) -> str | None:
        """The name ``pattern.format(**kw)`` has in the checkpoint, under the text model's prefixes of
        multimodal checkpoints; None when it is not there."""
        for prefix in _PREFIXES:
            name = prefix + pattern.format(**kw)
            if prefix == "model.language_model." and name.startswith("model.language_model.model."):
                name = name.replace("model.language_model.model.", "model.language_model.", 1)
            if name in self._files:
                return name
        return None

    def where(self, name: str) -> str:
        """``name in <its shard>`` for messages (the name alone when the checkpoint lacks it)."""
        return f"{name} in {self._files[name].name}" if name in self._files else name
