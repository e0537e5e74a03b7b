"""NVFP4 experts as checkpoints ship them, read without changing a value (but one rounding of
compressed-tensors' divided global scale).

- ModelOpt: per linear ``weight`` uint8 ``[N, K/2]`` (two e2m1 codes a byte, the low nibble first),
  ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` fp32 (one value);
  w = e2m1 * weight_scale * weight_scale_2.
- compressed-tensors ``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale`` as above and
  ``weight_global_scale`` fp32 ``[1]``; w = e2m1 * weight_scale / weight_global_scale (its inverse is
  taken once, in fp32: 2^-24 relative).

Each becomes NVFP4's canonical tensors (``kt_sglang.engine.canonical``): codes, e4m3 scales and the
matrix's multiplying global_scale. Read as is by NVFP4; dequantized for the methods that quantize.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.formats.base import PerExpertFormat, dequantized
from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.engine.methods import Method
    from kt_sglang.weights.checkpoint import Checkpoint

# (packed weight, global scale, whether the global scale divides) per writer
_LAYOUTS = {
    "modelopt": ("weight", "weight_scale_2", False),
    "compressed-tensors": ("weight_packed", "weight_global_scale", True),
}


class Nvfp4Format(PerExpertFormat):
    """Located by its global scale: a linear (its name prefix) with one is NVFP4, whichever writer."""

    name = "nvfp4"
    input_type = "fp4"
    group = 16  # K-values per e4m3 scale: the format's (tests check NVFP4's row of the native table)

    def locate(self, ckpt: Checkpoint, pattern: str, layer: int, expert: int) -> str | None:
        prefix = pattern.removesuffix(".weight")
        for _, global_suffix, _ in _LAYOUTS.values():
            name = ckpt.source.resolve(f"{prefix}.{global_suffix}", layer=layer, expert=expert)
            if name is not None:
                return name.removesuffix("." + global_suffix)
        return None

    def stored_name(self, ckpt: Checkpoint, where: str) -> str:
        return where + (".weight" if ckpt.source.has(where + ".weight") else ".weight_packed")

    def read_values(self, ckpt: Checkpoint, where: str, shape: tuple[int, int]) -> torch.Tensor:
        return dequantized(self.name, self.read_matrix(ckpt, where, shape), shape[1])

    def native_reader(self, ckpt: Checkpoint, layer: int, method: Method):
        return lambda base, shape: self.read_matrix(ckpt, base, shape)

    def read_matrix(self, ckpt: Checkpoint, base: str, shape: tuple[int, int]) -> CanonicalMatrix:
        """One linear ``[N, K]`` as NVFP4 canonical tensors."""
        from kt_sglang.engine.canonical import CanonicalMatrix

        src, G = ckpt.source, self.group
        N, K = shape
        writer = next(w for w, (_, g, _) in _LAYOUTS.items() if src.has(f"{base}.{g}"))
        weight_suffix, global_suffix, divides = _LAYOUTS[writer]
        if K % G:
            raise CheckpointError(f"{base}: K = {K} is not a multiple of {G}, as NVFP4 needs")

        def get(suffix: str, dtype: torch.dtype, expected: tuple[int, ...]) -> torch.Tensor:
            name = f"{base}.{suffix}"
            if not src.has(name):
                raise CheckpointError(
                    f"tensor {name} is missing from {ckpt.path} (NVFP4 checkpoint, {writer})"
                )
            t = src.tensor(name)
            if t.dtype != dtype or tuple(t.shape) != expected:
                raise CheckpointError(
                    f"{src.where(name)} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}; "
                    f"expected {str(dtype).removeprefix('torch.')} {list(expected)} "
                    f"(a [{N}, {K}] weight, groups of {G})"
                )
            return t

        weight = get(weight_suffix, torch.uint8, (N, K // 2))
        scales = get("weight_scale", torch.float8_e4m3fn, (N, K // G))
        global_name = f"{base}.{global_suffix}"
        g = src.tensor(global_name)
        if g.dtype != torch.float32 or g.numel() != 1:
            raise CheckpointError(f"{src.where(global_name)} is {g.dtype} {list(g.shape)}; expected one fp32")
        value = float(g.reshape(()))
        if not (value > 0 and torch.isfinite(g).all()):
            raise CheckpointError(f"{src.where(global_name)} is {value}; expected a positive finite scale")
        global_scale = (1.0 / g.reshape(1)) if divides else g.reshape(1)
        return CanonicalMatrix(
            weight.contiguous(), scales.contiguous(), global_scale=global_scale.contiguous()
        )


NVFP4 = Nvfp4Format()
