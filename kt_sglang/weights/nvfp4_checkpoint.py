"""NVFP4 experts as checkpoints ship them, read without changing a value (but one rounding of
compressed-tensors' divided global scale).

- ModelOpt: per linear ``weight`` uint8 ``[N, K/2]`` (two e2m1 codes a byte, the low nibble first),
  ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` fp32 (one value);
  w = e2m1 * weight_scale * weight_scale_2.
- compressed-tensors ``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale`` as above and
  ``weight_global_scale`` fp32 ``[1]``; w = e2m1 * weight_scale / weight_global_scale (its inverse is
  taken once, in fp32: 2^-24 relative).

Each becomes NVFP4's canonical tensors (``kt_sglang.engine.canonical``): codes, e4m3 scales and the
matrix's multiplying global_scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.weights.checkpoint import Checkpoint

FORMAT = "nvfp4"
GROUP = 16  # K-values per e4m3 scale: the format's (tests check NVFP4's row of the native table)
# (packed weight, global scale, whether the global scale divides) per writer
_LAYOUTS = {
    "modelopt": ("weight", "weight_scale_2", False),
    "compressed-tensors": ("weight_packed", "weight_global_scale", True),
}


def _error(message: str):

    return CheckpointError(message)


def base_name(ckpt: Checkpoint, pattern: str, **kw) -> str | None:
    """The name prefix of one linear (``....gate_proj``) stored as NVFP4, or None."""
    prefix = pattern.removesuffix(".weight")
    for _, global_suffix, _ in _LAYOUTS.values():
        name = ckpt.resolve(f"{prefix}.{global_suffix}", **kw)
        if name is not None:
            return name.removesuffix("." + global_suffix)
    return None


def read_expert(ckpt: Checkpoint, base: str, shape: tuple[int, int]) -> CanonicalMatrix:
    """One linear ``[N, K]`` as NVFP4 canonical tensors."""
    from kt_sglang.engine.canonical import CanonicalMatrix

    N, K = shape
    writer = next(w for w, (_, g, _) in _LAYOUTS.items() if ckpt.has(f"{base}.{g}"))
    weight_suffix, global_suffix, divides = _LAYOUTS[writer]
    if K % GROUP:
        raise _error(f"{base}: K = {K} is not a multiple of {GROUP}, as NVFP4 needs")

    def get(suffix: str, dtype: torch.dtype, expected: tuple[int, ...]) -> torch.Tensor:
        name = f"{base}.{suffix}"
        if not ckpt.has(name):
            raise _error(f"tensor {name} is missing from {ckpt.path} (NVFP4 checkpoint, {writer})")
        t = ckpt.tensor(name)
        if t.dtype != dtype or tuple(t.shape) != expected:
            raise _error(
                f"{ckpt.where(name)} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}; "
                f"expected {str(dtype).removeprefix('torch.')} {list(expected)} "
                f"(a [{N}, {K}] weight, groups of {GROUP})"
            )
        return t

    weight = get(weight_suffix, torch.uint8, (N, K // 2))
    scales = get("weight_scale", torch.float8_e4m3fn, (N, K // GROUP))
    g = ckpt.tensor(f"{base}.{global_suffix}")
    if g.dtype != torch.float32 or g.numel() != 1:
        raise _error(
            f"{ckpt.where(base + '.' + global_suffix)} is {g.dtype} {list(g.shape)}; expected one fp32"
        )
    value = float(g.reshape(()))
    if not (value > 0 and torch.isfinite(g).all()):
        raise _error(f"{ckpt.where(base + '.' + global_suffix)} is {value}; expected a positive finite scale")
    global_scale = (1.0 / g.reshape(1)) if divides else g.reshape(1)
    return CanonicalMatrix(weight.contiguous(), scales.contiguous(), global_scale=global_scale.contiguous())
