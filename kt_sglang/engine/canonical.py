"""Canonical quantized expert matrices: the ISA- and NUMA-independent format the engine packs from.

One matrix ``W [N, K]`` (K not padded; the last group may be partial), as in
``native/include/kt/quantize.h``:

- ``BF16``: ``weight`` bf16 ``[N, K]``
- ``AMXINT8``: ``weight`` int8 ``[N, K]`` in -127..127, ``scales`` fp16 ``[N, G]``; w = scale * q
- ``AMXINT4``: ``weight`` uint8 ``[N, ceil(K/2)]`` (low nibble = even k, q in 0..15), ``scales`` and
  ``mins`` fp16 ``[N, G]``; w = scale * q + min

with ``G = ceil(K / group)``. The weight files of a later stage store exactly these tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kt_sglang.engine.methods import Method, parse_method, resolve_group
from kt_sglang.engine.native import NATIVE_DTYPES, _native


@dataclass
class CanonicalMatrix:
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None


def canonical_layout(
    method: Method, group: int, N: int, K: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected shape and dtype of each tensor of one canonical matrix."""
    G = -(-K // group)
    if method is Method.BF16:
        return {"weight": ((N, K), torch.bfloat16)}
    if method is Method.AMXINT8:
        return {"weight": ((N, K), torch.int8), "scales": ((N, G), torch.float16)}
    return {
        "weight": ((N, (K + 1) // 2), torch.uint8),
        "scales": ((N, G), torch.float16),
        "mins": ((N, G), torch.float16),
    }


def quantize(method: str | Method, w: torch.Tensor, group_size: int | None = None) -> CanonicalMatrix:
    """Quantizes a dense ``[N, K]`` bf16/fp16/fp32 CPU matrix (the engine's own quantizer)."""
    method = parse_method(method)
    group = resolve_group(method, group_size)
    if w.dim() != 2 or w.dtype not in NATIVE_DTYPES or w.device.type != "cpu":
        raise ValueError(
            f"need a 2-D bf16/fp16/fp32 CPU matrix, got {tuple(w.shape)} {w.dtype} on {w.device}"
        )
    N, K = w.shape
    src = w.contiguous()
    out = {
        name: torch.empty(shape, dtype=dtype)
        for name, (shape, dtype) in canonical_layout(method, group, N, K).items()
    }
    _native.quantize_matrix(
        method.native,
        group,
        src.data_ptr(),
        NATIVE_DTYPES[src.dtype],
        N,
        K,
        out["weight"].data_ptr(),
        out["scales"].data_ptr() if "scales" in out else 0,
        out["mins"].data_ptr() if "mins" in out else 0,
    )
    return CanonicalMatrix(out["weight"], out.get("scales"), out.get("mins"))


def check_matrix(
    m: CanonicalMatrix, method: Method, group: int, N: int, K: int, what: str
) -> tuple[int, int, int]:
    """Validates one canonical matrix; returns the data pointers (weight, scales, mins; 0 = absent)."""
    ptrs = []
    for name, (shape, dtype) in canonical_layout(method, group, N, K).items():
        t = getattr(m, name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}.{name} is missing ({method.value} needs {dtype} {list(shape)})")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{what}.{name} is {t.dtype} {list(t.shape)}; expected {dtype} {list(shape)}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{what}.{name} must be a contiguous CPU tensor")
        ptrs.append(t.data_ptr())
    ptrs += [0] * (3 - len(ptrs))
    return tuple(ptrs)
