"""INT4 experts as checkpoints ship them, read without changing a value.

- compressed-tensors ``pack-quantized`` (Kimi-K2-Thinking, K2.5): per linear ``weight_packed`` int32
  ``[N, K/8]`` (8 nibbles along K, least significant first, value = nibble - 8), ``weight_scale``
  bf16 ``[N, K/g]``, ``weight_shape`` ``[N, K]``; symmetric groups along K. -> ``RAWINT4``
- GPTQ: ``qweight`` int32 ``[K/8, N]`` (8 nibbles along K), ``scales`` fp16 ``[K/g, N]``,
  ``qzeros`` int32 ``[K/g, N/8]`` (8 nibbles along N; the original "gptq" format stores zero - 1,
  "gptq_v2" the zero itself), ``g_idx`` int32 ``[K]``. -> ``GPTQ_INT4``

Each becomes the method's canonical tensors (``kt_sglang.engine.canonical``): the nibbles as bytes
with the low nibble at the even k, the scales (and zeros) per row and group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.weights.checkpoint import Checkpoint

PACK_QUANTIZED = "pack-quantized"
GPTQ = "gptq"
FORMATS = (PACK_QUANTIZED, GPTQ)

_SUFFIXES = {
    PACK_QUANTIZED: ("weight_packed", "weight_scale", "weight_shape"),
    GPTQ: ("qweight", "scales", "qzeros", "g_idx"),
}


@dataclass(frozen=True)
class Int4Scheme:
    format: str  # PACK_QUANTIZED or GPTQ
    group: int
    symmetric: bool
    zeros_stored_minus_one: bool = False  # GPTQ's original format


def packed_suffix(fmt: str) -> str:
    """The name suffix of a format's packed weight tensor."""
    return _SUFFIXES[fmt][0]


def detect_format(ckpt: Checkpoint, weight_name: str) -> str | None:
    """PACK_QUANTIZED or GPTQ when the linear whose weight would be ``weight_name`` (``....weight``)
    is stored so, else None (compressed-tensors' NVFP4 has a weight_packed too: callers ask
    nvfp4_checkpoint first)."""
    base = weight_name.removesuffix(".weight")
    for fmt, suffixes in _SUFFIXES.items():
        if ckpt.has(f"{base}.{suffixes[0]}"):
            return fmt
    return None


def base_name(ckpt: Checkpoint, pattern: str, **kw) -> str | None:
    """The name prefix of one linear (``....gate_proj``) whose INT4 tensors the checkpoint holds."""
    for suffixes in _SUFFIXES.values():
        name = ckpt.resolve(pattern.removesuffix(".weight") + "." + suffixes[0], **kw)
        if name is not None:
            return name.removesuffix("." + suffixes[0])
    return None


def _config_error(ckpt: Checkpoint, what: str):

    return CheckpointError(f"{ckpt.path / 'config.json'}: quantization_config {what}")


def read_scheme(ckpt: Checkpoint, fmt: str, module: str) -> Int4Scheme:
    """The checkpoint's quantization scheme for ``module`` (a linear's name), from its config; raises
    naming what does not fit an INT4 method."""
    q = ckpt.quantization
    if fmt == PACK_QUANTIZED:
        if q.get("quant_method") != "compressed-tensors" or q.get("format") != PACK_QUANTIZED:
            raise _config_error(
                ckpt,
                f"is {q.get('quant_method')!r} / {q.get('format')!r}; {module} holds weight_packed, "
                "which needs compressed-tensors with format 'pack-quantized'",
            )
        weights = _compressed_tensors_weights(ckpt, module)
        if (
            weights.get("num_bits") != 4
            or weights.get("type", "int") != "int"
            or weights.get("strategy") != "group"
        ):
            raise _config_error(
                ckpt,
                f"quantizes {module} with {weights.get('num_bits')}-bit {weights.get('type')} weights, "
                f"strategy {weights.get('strategy')!r}; RAWINT4 reads 4-bit int weights in groups",
            )
        if not weights.get("symmetric", False):
            raise _config_error(
                ckpt,
                f"quantizes {module} asymmetrically (symmetric: false); RAWINT4 reads symmetric "
                "weights only (value = nibble - 8)",
            )
        if weights.get("actorder") not in (None, "weight"):
            raise _config_error(
                ckpt,
                f"has actorder {weights.get('actorder')!r} for {module}: its groups are permuted along "
                "K, which RAWINT4 does not read; use a checkpoint quantized without activation order",
            )
        return Int4Scheme(PACK_QUANTIZED, _group(ckpt, fmt, weights.get("group_size"), module), True)
    if fmt == GPTQ:
        if q.get("quant_method") != "gptq":
            raise _config_error(
                ckpt, f"has quant_method {q.get('quant_method')!r}; {module} holds GPTQ's qweight"
            )
        if q.get("bits") != 4:
            raise _config_error(ckpt, f"has bits {q.get('bits')}; GPTQ_INT4 reads 4-bit GPTQ")
        version = q.get("checkpoint_format", "gptq")
        if version not in ("gptq", "gptq_v2"):
            raise _config_error(
                ckpt, f"has checkpoint_format {version!r}; GPTQ_INT4 reads 'gptq' and 'gptq_v2'"
            )
        return Int4Scheme(
            GPTQ, _group(ckpt, fmt, q.get("group_size"), module), bool(q.get("sym", True)), version == "gptq"
        )
    raise ValueError(f"unknown INT4 checkpoint format {fmt!r}")


def _group(ckpt: Checkpoint, fmt: str, group, module: str) -> int:
    from kt_sglang.engine.methods import METHODS, method_for_format

    allowed = METHODS[method_for_format(fmt)].allowed_groups
    if group is None:
        raise _config_error(ckpt, f"states no group_size for {module}")
    if int(group) not in allowed:
        raise _config_error(
            ckpt,
            f"has group_size {group} for {module}; {method_for_format(fmt).value} reads groups of "
            f"{', '.join(map(str, allowed))}",
        )
    return int(group)


def _compressed_tensors_weights(ckpt: Checkpoint, module: str) -> dict:
    """The ``weights`` scheme of the config group that targets ``module``, unless it is ignored."""
    q = ckpt.quantization
    for pattern in q.get("ignore") or []:
        if _matches(pattern, module):
            raise _config_error(
                ckpt, f"ignores {module} (pattern {pattern!r}): the expert is not quantized there"
            )
    for name, group in (q.get("config_groups") or {}).items():
        for target in group.get("targets") or []:
            if target == "Linear" or _matches(target, module):
                weights = group.get("weights")
                if not weights:
                    raise _config_error(ckpt, f"group {name!r} has no weights scheme")
                return weights
    raise _config_error(ckpt, f"has no config_groups entry whose targets match {module}")


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def read_matrix(ckpt: Checkpoint, base: str, scheme: Int4Scheme, shape: tuple[int, int]) -> CanonicalMatrix:
    """One linear ``[N, K]`` as RAWINT4 / GPTQ_INT4 canonical tensors, values unchanged."""
    from kt_sglang.engine.canonical import CanonicalMatrix

    N, K = shape
    g = scheme.group
    groups = -(-K // g)

    def get(suffix: str, dtypes: tuple[torch.dtype, ...], expected: tuple[int, ...]) -> torch.Tensor:
        name = f"{base}.{suffix}"
        if not ckpt.has(name):
            raise CheckpointError(f"tensor {name} is missing from {ckpt.path} ({scheme.format} checkpoint)")
        t = ckpt.tensor(name)
        if t.dtype not in dtypes or tuple(t.shape) != expected:
            want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(
                f"{ckpt.where(name)} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}; "
                f"expected {want} {list(expected)} (a [{N}, {K}] weight, groups of {g})"
            )
        return t

    if scheme.format == PACK_QUANTIZED:
        if K % 8:
            raise CheckpointError(f"{base}: K = {K} is not a multiple of 8, as weight_packed needs")
        shape_t = get("weight_shape", (torch.int32, torch.int64), (2,))
        if [int(v) for v in shape_t] != [N, K]:
            raise CheckpointError(
                f"{ckpt.where(base + '.weight_shape')} says {[int(v) for v in shape_t]}; "
                f"the model's config needs [{N}, {K}]"
            )
        packed = get("weight_packed", (torch.int32,), (N, K // 8))
        scales = get("weight_scale", (torch.bfloat16,), (N, groups))
        _check_finite(ckpt, base + ".weight_scale", scales)
        # int32 little-endian: byte j holds nibbles 2j (low) and 2j + 1 (high), as canonical
        return CanonicalMatrix(packed.contiguous().view(torch.uint8).reshape(N, K // 2), scales.contiguous())
    if K % 8 or N % 8:
        raise CheckpointError(f"{base}: [{N}, {K}] is not a multiple of 8 in both sizes, as GPTQ packs")
    qweight = get("qweight", (torch.int32,), (K // 8, N))
    scales = get("scales", (torch.float16,), (groups, N))
    qzeros = get("qzeros", (torch.int32,), (groups, N // 8))
    if ckpt.has(base + ".g_idx"):
        g_idx = get("g_idx", (torch.int32, torch.int64), (K,))
        if not torch.equal(g_idx.long(), torch.arange(K) // g):
            raise CheckpointError(
                f"{ckpt.where(base + '.g_idx')} permutes the groups (GPTQ act-order, desc_act=true); "
                "GPTQ_INT4 reads checkpoints quantized with desc_act=false only"
            )
    _check_finite(ckpt, base + ".scales", scales)
    weight = qweight.contiguous().view(torch.uint8).reshape(K // 8, N, 4).permute(1, 0, 2)
    zeros = _nibbles(qzeros).reshape(groups, N)
    if scheme.zeros_stored_minus_one:
        zeros = zeros + 1
    return CanonicalMatrix(
        weight.reshape(N, K // 2).contiguous(), scales.t().contiguous(), zeros=zeros.t().contiguous()
    )


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., n]`` -> uint8 ``[..., 8 n]``, the least significant nibble first."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def _check_finite(ckpt: Checkpoint, name: str, t: torch.Tensor) -> None:

    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"scales {ckpt.where(name)} hold NaN or infinite values")


def dequantize(m: CanonicalMatrix, scheme: Int4Scheme, K: int) -> torch.Tensor:
    """float32 ``[N, K]`` of a matrix read by ``read_matrix`` (for methods that quantize it again)."""
    from kt_sglang.engine.canonical import dequantize as canonical_dequantize
    from kt_sglang.engine.methods import method_for_format

    return canonical_dequantize(method_for_format(scheme.format), m, K, scheme.group)
