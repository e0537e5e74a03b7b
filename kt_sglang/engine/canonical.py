"""Canonical quantized expert matrices: the ISA- and NUMA-independent format the engine packs from.

One matrix ``W [N, K]`` (K not padded; the last group may be partial) is the tensors its method's
row of the native table lists (``METHODS[m].tensors``; ``native/include/kt/quantize.h``), e.g.

- ``BF16``: ``weight`` bf16 ``[N, K]``
- ``AMXINT8``: ``weight`` int8 ``[N, K]`` in -127..127, ``scales`` fp16 ``[N, G]``; w = scale * q
- ``AMXINT4``: ``weight`` uint8 ``[N, ceil(K/2)]`` (low nibble = even k, q in 0..15), ``scales`` and
  ``mins`` fp16 ``[N, G]``; w = scale * q + min
- ``FP8``: ``weight`` float8_e4m3fn ``[N, K]``, ``scales`` fp32 ``[ceil(N/128), ceil(K/128)]``
- ``FP8_PERCHANNEL``: ``weight`` float8_e4m3fn ``[N, K]``, ``scales`` fp32 ``[N]``
- ``RAWINT4``: ``weight`` as AMXINT4's, ``scales`` bf16 ``[N, G]``; w = scale * (q - 8)
- ``GPTQ_INT4``: ``weight`` as AMXINT4's, ``scales`` fp16 and ``zeros`` uint8 ``[N, G]``;
  w = scale * (q - zero)

with ``G = ceil(K / group)``. The weight files of a later stage store exactly these tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kt_sglang.engine.methods import METHODS, Method, parse_method, resolve_group
from kt_sglang.engine.native import NATIVE_DTYPES, _native

# The values of the 16 float4 e2m1 codes (sign in bit 3).
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


@dataclass
class CanonicalMatrix:
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None


def canonical_layout(
    method: Method, group: int, N: int, K: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected shape and dtype of each tensor of one canonical matrix."""
    return {t.name: (t.shape_for(N, K, group), t.dtype) for t in METHODS[method].tensors}


def dequantize(
    method: str | Method, m: CanonicalMatrix, K: int, group_size: int | None = None
) -> torch.Tensor:
    """The float32 ``[N, K]`` matrix a canonical one stands for, computed in torch (the tests'
    reference, independent of the engine)."""
    method = parse_method(method)
    group = resolve_group(method, group_size)
    w = m.weight
    if w.dtype == torch.uint8:  # two nibbles a byte, low = even k
        q = torch.stack([w & 0x0F, w >> 4], dim=-1).reshape(w.shape[0], -1)[:, :K].float()
    else:
        q = w.float()
    if METHODS[method].weight_codes == "e2m1":
        q = E2M1_VALUES[q.long()]
    q = q - METHODS[method].weight_zero
    N = q.shape[0]

    def expand(t: torch.Tensor) -> torch.Tensor:  # a scale table -> one value per weight
        t = t.float()
        if t.dim() == 1:
            return t[:, None].expand(N, K)
        if t.shape[0] != N:  # blocks of group x group
            t = t.repeat_interleave(group, 0)[:N]
        return t.repeat_interleave(group, 1)[:, :K]

    if m.zeros is not None:
        q = q - expand(m.zeros)
    out = q if m.scales is None else q * expand(m.scales)
    if m.global_scale is not None:
        out = out * m.global_scale.float()
    return out if m.mins is None else out + expand(m.mins)


def quantize(method: str | Method, w: torch.Tensor, group_size: int | None = None) -> CanonicalMatrix:
    """Quantizes a dense ``[N, K]`` bf16/fp16/fp32 CPU matrix (the engine's own quantizer)."""
    method = parse_method(method)
    group = resolve_group(method, group_size)
    if not METHODS[method].quantizes_dense:
        raise ValueError(f"{method.value} weights come from checkpoints as they are; it cannot quantize")
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


def random_canonical(
    method: str | Method, N: int, K: int, group_size: int | None = None, seed: int = 0
) -> CanonicalMatrix:
    """A random matrix in a method's own canonical tensors, with weights of about N(0, 1/K): how
    bench, check-engine and the tests make layers of the methods that come from checkpoints only
    (RAWINT4, GPTQ_INT4), whose values no quantizer of the engine writes."""
    method = parse_method(method)
    group = resolve_group(method, group_size)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in canonical_layout(method, group, N, K).items():
        if name == "weight" and dtype == torch.uint8:  # nibbles
            out[name] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        elif name == "zeros":
            out[name] = torch.randint(6, 11, shape, generator=gen, dtype=torch.uint8)
        elif name == "scales" and dtype == torch.float8_e8m0fnu:  # e2m1 values spread about 2.9
            e = torch.randint(-1, 2, shape, generator=gen) + 127 - round(math.log2(2.9 * K**0.5))
            out[name] = e.to(torch.uint8).view(torch.float8_e8m0fnu)
        elif name == "scales" and dtype == torch.float8_e4m3fn:  # times global_scale 2^-4
            scales = ((0.5 + torch.rand(shape, generator=gen)) * 16 / (2.9 * K**0.5)).to(dtype)
            subnormal = torch.rand(shape, generator=gen) < 0.1  # e4m3 codes 1..7: exponent 0
            codes = torch.randint(1, 8, shape, generator=gen, dtype=torch.uint8)
            out[name] = torch.where(subnormal, codes, scales.view(torch.uint8)).view(dtype)
        elif name == "global_scale":
            out[name] = torch.full(shape, 1 / 16)
        elif name == "scales":  # nibbles minus their zero spread about 4.6
            out[name] = ((0.5 + torch.rand(shape, generator=gen)) / (4.6 * K**0.5)).to(dtype)
        else:
            raise ValueError(f"random_canonical does not make {method.value}'s {name}; use quantize()")
    return CanonicalMatrix(**out)


def random_experts(
    method: str | Method, E: int, I: int, H: int, group_size: int | None = None, seed: int = 0
) -> tuple[
    tuple[list[CanonicalMatrix], list[CanonicalMatrix], list[CanonicalMatrix]], tuple[torch.Tensor, ...]
]:
    """A layer of random experts in a method's canonical tensors (``random_canonical``): the gate,
    up and down matrices to ``load_canonical``, and their float32 values ``[E, I, H]``, ``[E, I, H]``,
    ``[E, H, I]`` for a reference."""
    mats = tuple(
        [random_canonical(method, N, K, group_size, seed=seed * 3 * E + 3 * e + p) for e in range(E)]
        for p, (N, K) in enumerate(((I, H), (I, H), (H, I)))
    )
    dense = tuple(
        torch.stack([dequantize(method, m, K, group_size) for m in proj])
        for proj, K in zip(mats, (H, H, I), strict=True)
    )
    return mats, dense


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
