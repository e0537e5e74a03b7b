"""Weight methods (`--kt-method`), read from the native table (native/include/kt/quant_types.h)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kt_sglang.engine.native import _native

# Named by kt-kernel and accepted by SGLang's flag, not implemented by this engine (yet).
UNSUPPORTED_METHODS = ("FP8", "RAWINT4", "GPTQ_INT4", "LLAMAFILE", "MOE_INT4", "MOE_INT8")


class Method(str, enum.Enum):
    BF16 = "BF16"
    AMXINT8 = "AMXINT8"
    AMXINT4 = "AMXINT4"

    def is_quantized(self) -> bool:
        return self is not Method.BF16

    @property
    def native(self) -> _native.Method:
        return getattr(_native.Method, self.value)


@dataclass(frozen=True)
class MethodInfo:
    method: Method
    default_group: int
    allowed_groups: tuple[int, ...]
    int8_activations: bool
    int8_h: bool  # the down projection reads h quantized to int8 (else bf16)


METHODS: dict[Method, MethodInfo] = {
    Method(row["name"]): MethodInfo(
        Method(row["name"]),
        row["default_group"],
        tuple(row["allowed_groups"]),
        row["int8_activations"],
        row["int8_h"],
    )
    for row in _native.method_table()
}


def parse_method(name: str | Method) -> Method:
    """`--kt-method` value -> Method, with a message naming what is supported."""
    if isinstance(name, Method):
        return name
    key = str(name).upper()
    if key in Method.__members__:
        return Method(key)
    supported = ", ".join(m.value for m in Method)
    if key in UNSUPPORTED_METHODS:
        raise ValueError(f"method {name!r} is not supported yet by kt-sglang; use one of {supported}")
    raise ValueError(f"unknown method {name!r}; use one of {supported}")


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
