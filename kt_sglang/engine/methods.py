"""Weight methods (`--kt-method`), built from the native table (native/include/kt/quant_types.h).

Nothing here names a method: the enum, the aliases, the canonical tensors, the group sizes and the
test bounds all come from ``_native.method_table()``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kt_sglang.engine.native import _native

# Named by kt-kernel for a weight file's own format: each layer takes its engine method from the
# file (a GGUF tensor's block type, kt_sglang.weights.gguf_blocks).
FILE_METHODS = ("LLAMAFILE",)

_TABLE = _native.method_table()


class _MethodBase(str, enum.Enum):
    @property
    def native(self) -> _native.Method:
        return getattr(_native.Method, self.value)

    @property
    def info(self) -> MethodInfo:
        return METHODS[self]

    def is_quantized(self) -> bool:
        """Whether the method stores scales (anything but plain bf16 weights)."""
        return len(self.info.tensors) > 1


Method = _MethodBase("Method", [(row["name"], row["name"]) for row in _TABLE])
Method.__doc__ = "A weight method of the CPU engine; its values are the `--kt-method` names."

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
}


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor of a matrix ``W [N, K]``: its name, dtype and shape rule."""

    name: str
    dtype: torch.dtype
    shape: str  # "N,K", "N,K/2", "N,K/group", "N/group,K/group", "N" or "1" (divisions round up)

    def shape_for(self, N: int, K: int, group: int) -> tuple[int, ...]:
        sizes = {"N": N, "K": K, "K/2": -(-K // 2), "K/group": -(-K // group), "N/group": -(-N // group)}
        sizes["1"] = 1
        return tuple(sizes[part] for part in self.shape.split(","))


@dataclass(frozen=True)
class MethodInfo:
    method: Method
    aliases: tuple[str, ...]
    summary: str
    default_group: int
    allowed_groups: tuple[int, ...]
    int8_activations: bool
    int8_h: bool  # the down projection reads h quantized to int8 (else bf16)
    weight_bits: int
    scale_bytes: int  # packed scale bytes per channel and group
    scale_extra_bytes: int  # packed bytes per group after the channels' scales (NVFP4's global)
    quantizes_dense: bool  # the engine quantizes bf16/fp16/fp32 weights to it
    weight_zero: int  # the stored weight that stands for 0 where no mins/zeros tensor says (RAWINT4: 8)
    weight_codes: str | None  # "e2m1": the packed weights are float4 codes, not integers
    checkpoint_format: str | None  # "fp8", "pack-quantized", "gptq", "mxfp4": read as is; None: quantized
    tensors: tuple[TensorSpec, ...]
    error_bound: float  # relative L2 error of a random layer against float32

    @property
    def bytes_per_weight(self) -> float:
        return self.weight_bits / 8


METHODS: dict[Method, MethodInfo] = {
    Method(row["name"]): MethodInfo(
        Method(row["name"]),
        tuple(row["aliases"]),
        row["summary"],
        row["default_group"],
        tuple(row["allowed_groups"]),
        row["int8_activations"],
        row["int8_h"],
        row["weight_bits"],
        row["scale_bytes"],
        row["scale_extra_bytes"],
        row["quantizes_dense"],
        row["weight_zero"],
        row["weight_codes"],
        row["checkpoint_format"],
        tuple(TensorSpec(name, _DTYPES[dtype], shape) for name, dtype, shape in row["tensors"]),
        row["error_bound"],
    )
    for row in _TABLE
}

_BY_NAME = {alias.upper(): m for m, info in METHODS.items() for alias in (m.value, *info.aliases)}


def method_names() -> list[str]:
    """Every `--kt-method` name, in the table's order (CLI choices)."""
    return [m.value for m in Method]


def parse_method(name: str | Method) -> Method:
    """`--kt-method` value or alias (any case) -> Method, with a message naming what is supported."""
    if isinstance(name, Method):
        return name
    key = str(name).upper()
    if key in _BY_NAME:
        return _BY_NAME[key]
    supported = ", ".join(method_names())
    if key in FILE_METHODS:
        raise ValueError(
            f"method {name!r} takes each layer's method from its weight file: give it with weight_path "
            f"(a layer's engine method is one of {supported})"
        )
    raise ValueError(f"unknown method {name!r}; use one of {supported}")


def method_for_format(checkpoint_format: str) -> Method:
    """The method that takes checkpoints of this format as they are (``MethodInfo.checkpoint_format``;
    FP8 checkpoints: the first of FP8 and FP8_PERCHANNEL)."""
    for m, info in METHODS.items():
        if info.checkpoint_format == checkpoint_format:
            return m
    raise ValueError(f"no method reads {checkpoint_format!r} checkpoints as they are")


def resolve_group(method: Method, group_size: int | None) -> int:
    info = METHODS[method]
    if group_size is None:
        return info.default_group
    if group_size not in info.allowed_groups:
        raise ValueError(
            f"group_size={group_size} is not allowed for {method.value}: "
            f"use one of {list(info.allowed_groups)}"
        )
    return group_size
