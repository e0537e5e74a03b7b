"""MXFP4 experts as checkpoints ship them, read without changing a value.

- gpt-oss: per layer ``{prefix}_blocks`` uint8 ``[E, N, K/32, 16]`` (two e2m1 codes a byte, the low
  nibble first), ``{prefix}_scales`` uint8 ``[E, N, K/32]`` (e8m0: 2^(s - 127)) and ``{prefix}_bias``
  ``[E, N]``, for ``gate_up`` (N = 2I, gate and up rows interleaved) and ``down`` (N = H).
- DeepSeek-V4-Flash: per expert ``w1/w3/w2.weight`` int8 / uint8 / float4_e2m1fn_x2 ``[N, K/2]``
  and ``.scale`` float8_e8m0fnu ``[N, K/32]`` (or the same powers of two in fp32, or uint8).

Each matrix becomes MXFP4's canonical tensors (``kt_sglang.engine.canonical``): the codes' bytes as
they are, and the scales as e8m0 bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.weights.checkpoint import Checkpoint

FORMAT = "mxfp4"
BLOCK = 32  # K-values per e8m0 scale: the format's (tests check MXFP4's row of the native table)
# Byte dtypes the packed e2m1 codes come in.
_CODE_DTYPES = tuple(
    d for d in (torch.uint8, torch.int8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None
)


def _error(message: str):

    return CheckpointError(message)


def is_packed(ckpt: Checkpoint, weight_name: str) -> bool:
    """Whether a per-expert ``.weight`` holds packed e2m1 codes: a byte dtype with an e8m0 ``.scale``
    beside it (an int8 weight with a ``weight_scale`` is another format)."""
    scale = weight_name.removesuffix(".weight") + ".scale"
    return ckpt.tensor(weight_name).dtype in _CODE_DTYPES and ckpt.has(scale)


def e8m0_bytes(t: torch.Tensor, where: str) -> torch.Tensor:
    """Scales as e8m0 bytes (uint8): from float8_e8m0fnu or uint8 as they are, from fp32 powers of two
    exactly (DeepSeek-V4-Flash-Base); anything else is refused, naming the tensor."""
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None and t.dtype == e8m0:
        return t.contiguous().view(torch.uint8)
    if t.dtype == torch.uint8:
        return t.contiguous()
    if t.dtype == torch.float32:
        mantissa, exponent = torch.frexp(t)
        if not bool(((mantissa == 0.5) & (exponent >= -125) & (exponent <= 128)).all()):
            raise _error(f"scales {where} are fp32 but not all powers of two 2^-126..2^127, as e8m0 needs")
        return (exponent - 1 + 127).to(torch.uint8)
    raise _error(f"scales {where} have dtype {t.dtype}; MXFP4 scales are float8_e8m0fnu, uint8 or fp32")


def _checked_scales(scales: torch.Tensor, where: str) -> torch.Tensor:
    if bool((scales == 0xFF).any()):
        raise _error(f"scales {where} hold 255, e8m0's NaN")
    return scales


def read_expert(ckpt: Checkpoint, weight_name: str, shape: tuple[int, int]) -> CanonicalMatrix:
    """One per-expert matrix ``[N, K]`` (DeepSeek-V4: ``.weight`` codes and ``.scale``)."""
    from kt_sglang.engine.canonical import CanonicalMatrix

    N, K = shape
    if K % BLOCK:
        raise _error(f"{weight_name}: K = {K} is not a multiple of {BLOCK}, as MXFP4 needs")
    w = ckpt.tensor(weight_name)
    if w.dtype not in _CODE_DTYPES or tuple(w.shape) != (N, K // 2):
        raise _error(
            f"{ckpt.where(weight_name)} is {w.dtype} {list(w.shape)}; MXFP4 expects packed e2m1 codes "
            f"(uint8, int8 or float4_e2m1fn_x2) [{N}, {K // 2}]"
        )
    scale_name = weight_name.removesuffix(".weight") + ".scale"
    if not ckpt.has(scale_name):
        raise _error(f"tensor {scale_name} is missing from {ckpt.path} (the e8m0 scales of {weight_name})")
    s = ckpt.tensor(scale_name)
    if tuple(s.shape) != (N, K // BLOCK):
        raise _error(
            f"scales {ckpt.where(scale_name)} have shape {list(s.shape)}; expected [{N}, {K // BLOCK}] "
            f"(one per {BLOCK} of the [{N}, {K}] weight)"
        )
    scales = _checked_scales(e8m0_bytes(s, ckpt.where(scale_name)), ckpt.where(scale_name))
    return CanonicalMatrix(w.contiguous().view(torch.uint8), scales.view(torch.float8_e8m0fnu))


def _fused_prefix(ckpt: Checkpoint, layer: int, proj: str) -> str:
    pattern = ckpt.family.fused_mxfp4[proj]
    name = ckpt.resolve(pattern + "_blocks", layer=layer)
    if name is None:
        missing = pattern.format(layer=layer) + "_blocks"
        raise _error(f"tensor {missing} is missing from {ckpt.path} (layer {layer}'s MXFP4 experts)")
    return name.removesuffix("_blocks")


def _rows(ckpt: Checkpoint):
    """Rows of the fused gate_up tensor that hold gate and up."""
    I = ckpt.spec.intermediate_size
    if ckpt.family.fused_mxfp4.get("gate_up_rows", "interleaved") == "interleaved":
        return slice(0, None, 2), slice(1, None, 2)
    return slice(0, I), slice(I, None)


def read_fused_layer(ckpt: Checkpoint, layer: int, ids: list[int]):
    """gate, up, down canonical matrices of experts ``ids`` of a gpt-oss layer."""
    from kt_sglang.engine.canonical import CanonicalMatrix

    spec = ckpt.spec
    E, I, H = spec.num_experts, spec.intermediate_size, spec.hidden_size
    out = {}
    for proj, N, K in (("gate_up", 2 * I, H), ("down", H, I)):
        prefix = _fused_prefix(ckpt, layer, proj)
        if K % BLOCK:
            raise _error(f"{prefix}: K = {K} is not a multiple of {BLOCK}, as MXFP4 needs")
        blocks = ckpt.tensor(prefix + "_blocks")
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (E, N, K // BLOCK, 16):
            raise _error(
                f"{ckpt.where(prefix + '_blocks')} is {blocks.dtype} {list(blocks.shape)}; expected uint8 "
                f"[{E}, {N}, {K // BLOCK}, 16]"
            )
        scale_name = prefix + "_scales"
        if not ckpt.has(scale_name):
            raise _error(f"tensor {scale_name} is missing from {ckpt.path}")
        s = ckpt.tensor(scale_name)
        if tuple(s.shape) != (E, N, K // BLOCK):
            raise _error(
                f"scales {ckpt.where(scale_name)} have shape {list(s.shape)}; "
                f"expected [{E}, {N}, {K // BLOCK}]"
            )
        scales = _checked_scales(e8m0_bytes(s, ckpt.where(scale_name)), ckpt.where(scale_name))
        out[proj] = (blocks[ids].reshape(len(ids), N, K // 2), scales[ids])

    def mats(pair, rows):
        w, s = pair
        return [
            CanonicalMatrix(w[i, rows].contiguous(), s[i, rows].contiguous().view(torch.float8_e8m0fnu))
            for i in range(len(ids))
        ]

    gate_rows, up_rows = _rows(ckpt)
    return mats(out["gate_up"], gate_rows), mats(out["gate_up"], up_rows), mats(out["down"], slice(None))


def read_fused_biases(ckpt: Checkpoint, layer: int, ids: list[int]):
    """gate, up ``[n, I]`` and down ``[n, H]`` fp32 biases of experts ``ids`` (None where absent)."""
    spec = ckpt.spec
    E, I, H = spec.num_experts, spec.intermediate_size, spec.hidden_size
    found = {}
    for proj, N in (("gate_up", 2 * I), ("down", H)):
        name = _fused_prefix(ckpt, layer, proj) + "_bias"
        found[proj] = None
        if ckpt.has(name):
            b = ckpt.tensor(name)
            if tuple(b.shape) != (E, N) or not b.dtype.is_floating_point:
                raise _error(f"{ckpt.where(name)} is {b.dtype} {list(b.shape)}; expected float [{E}, {N}]")
            if not bool(torch.isfinite(b).all()):
                raise _error(f"{ckpt.where(name)} holds NaN or infinite values")
            found[proj] = b[ids].float()
    gb = found["gate_up"]
    gate_rows, up_rows = _rows(ckpt)
    if gb is None:
        return None, None, found["down"]
    return gb[:, gate_rows].contiguous(), gb[:, up_rows].contiguous(), found["down"]
