"""MXFP4 experts as checkpoints ship them, read without changing a value, in two layouts:

- per expert (DeepSeek-V4-Flash): ``w1/w3/w2.weight`` int8 / uint8 / float4_e2m1fn_x2 ``[N, K/2]``
  (two e2m1 codes a byte, the low nibble first) and ``.scale`` float8_e8m0fnu ``[N, K/32]`` (or the
  same powers of two in fp32, or uint8);
- fused per layer (gpt-oss, the family's ``fused_mxfp4`` names): ``{prefix}_blocks`` uint8
  ``[E, N, K/32, 16]``, ``{prefix}_scales`` uint8 ``[E, N, K/32]`` (e8m0: 2^(s - 127)) and
  ``{prefix}_bias`` ``[E, N]``, for ``gate_up`` (N = 2I, gate and up rows interleaved or in halves)
  and ``down`` (N = H).

Each matrix becomes MXFP4's canonical tensors (``kt_sglang.engine.canonical``): the codes' bytes as
they are, and the scales as e8m0 bytes. Read as is by MXFP4; dequantized for the methods that quantize.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.formats.base import ExpertFormat, PerExpertFormat, dequantized
from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.engine.methods import Method
    from kt_sglang.weights.checkpoint import Checkpoint

FORMAT = "mxfp4"
BLOCK = 32  # K-values per e8m0 scale: the format's (tests check MXFP4's row of the native table)
# Byte dtypes the packed e2m1 codes come in.
_CODE_DTYPES = tuple(
    d for d in (torch.uint8, torch.int8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None
)


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
            raise CheckpointError(
                f"scales {where} are fp32 but not all powers of two 2^-126..2^127, as e8m0 needs"
            )
        return (exponent - 1 + 127).to(torch.uint8)
    raise CheckpointError(
        f"scales {where} have dtype {t.dtype}; MXFP4 scales are float8_e8m0fnu, uint8 or fp32"
    )


def _checked_scales(scales: torch.Tensor, where: str) -> torch.Tensor:
    if bool((scales == 0xFF).any()):
        raise CheckpointError(f"scales {where} hold 255, e8m0's NaN")
    return scales


class Mxfp4Format(PerExpertFormat):
    """Per-expert MXFP4: a byte ``.weight`` with an e8m0 ``.scale`` beside it (an int8 weight with a
    ``weight_scale`` is another format)."""

    name = FORMAT
    input_type = "fp4"
    group = BLOCK

    def claims(self, ckpt: Checkpoint, where: str) -> bool:
        scale = where.removesuffix(".weight") + ".scale"
        return ckpt.source.dtype(where) in _CODE_DTYPES and ckpt.source.has(scale)

    def read_values(self, ckpt: Checkpoint, where: str, shape: tuple[int, int]) -> torch.Tensor:
        N, half = ckpt.source.shape(where)[:2]  # read as stored: a misshaped one is named after
        return dequantized(self.name, self.read_matrix(ckpt, where, (N, 2 * half)), 2 * half)

    def native_reader(self, ckpt: Checkpoint, layer: int, method: Method):
        return lambda where, shape: self.read_matrix(ckpt, where, shape)

    def read_matrix(self, ckpt: Checkpoint, weight_name: str, shape: tuple[int, int]) -> CanonicalMatrix:
        """One matrix ``[N, K]``: its ``.weight`` codes and ``.scale``."""
        from kt_sglang.engine.canonical import CanonicalMatrix

        src, B = ckpt.source, self.group
        N, K = shape
        if K % B:
            raise CheckpointError(f"{weight_name}: K = {K} is not a multiple of {B}, as MXFP4 needs")
        w = src.tensor(weight_name)
        if w.dtype not in _CODE_DTYPES or tuple(w.shape) != (N, K // 2):
            raise CheckpointError(
                f"{src.where(weight_name)} is {w.dtype} {list(w.shape)}; MXFP4 expects packed e2m1 codes "
                f"(uint8, int8 or float4_e2m1fn_x2) [{N}, {K // 2}]"
            )
        scale_name = weight_name.removesuffix(".weight") + ".scale"
        if not src.has(scale_name):
            raise CheckpointError(
                f"tensor {scale_name} is missing from {ckpt.path} (the e8m0 scales of {weight_name})"
            )
        s = src.tensor(scale_name)
        if tuple(s.shape) != (N, K // B):
            raise CheckpointError(
                f"scales {src.where(scale_name)} have shape {list(s.shape)}; expected [{N}, {K // B}] "
                f"(one per {B} of the [{N}, {K}] weight)"
            )
        scales = _checked_scales(e8m0_bytes(s, src.where(scale_name)), src.where(scale_name))
        return CanonicalMatrix(w.contiguous().view(torch.uint8), scales.view(torch.float8_e8m0fnu))


class FusedMxfp4Format(ExpertFormat):
    """gpt-oss: a layer's experts in one ``_blocks`` / ``_scales`` / ``_bias`` set per projection,
    under the names the family declares (``fused_mxfp4``)."""

    name = FORMAT
    input_type = "fp4"
    group = BLOCK

    def detect(self, ckpt: Checkpoint, layer: int) -> bool:
        return bool(ckpt.family.fused_mxfp4)

    def stored_dtype(self, ckpt: Checkpoint, layer: int) -> torch.dtype:
        return ckpt.source.dtype(_prefix(ckpt, layer, "gate_up") + "_blocks")

    def values(self, ckpt: Checkpoint, layer: int, ids: list[int]) -> tuple:
        I, H = ckpt.spec.intermediate_size, ckpt.spec.hidden_size
        mats = self.native(ckpt, layer, ids, None)
        return tuple(
            torch.stack([dequantized(self.name, m, K) for m in proj]) if proj else torch.empty(0, N, K)
            for proj, (N, K) in zip(mats, ((I, H), (I, H), (H, I)), strict=True)
        )

    def iter_values(self, ckpt: Checkpoint, layer: int):
        yield from zip(*self.values(ckpt, layer, list(range(ckpt.spec.num_experts))), strict=True)

    def native(self, ckpt: Checkpoint, layer: int, ids: list[int], method: Method | None) -> tuple:
        """gate, up, down canonical matrices of experts ``ids``."""
        from kt_sglang.engine.canonical import CanonicalMatrix

        spec, src, B = ckpt.spec, ckpt.source, self.group
        E, I, H = spec.num_experts, spec.intermediate_size, spec.hidden_size
        out = {}
        for proj, N, K in (("gate_up", 2 * I, H), ("down", H, I)):
            prefix = _prefix(ckpt, layer, proj)
            if K % B:
                raise CheckpointError(f"{prefix}: K = {K} is not a multiple of {B}, as MXFP4 needs")
            blocks = src.tensor(prefix + "_blocks")
            if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (E, N, K // B, 16):
                raise CheckpointError(
                    f"{src.where(prefix + '_blocks')} is {blocks.dtype} {list(blocks.shape)}; expected "
                    f"uint8 [{E}, {N}, {K // B}, 16]"
                )
            scale_name = prefix + "_scales"
            if not src.has(scale_name):
                raise CheckpointError(f"tensor {scale_name} is missing from {ckpt.path}")
            s = src.tensor(scale_name)
            if tuple(s.shape) != (E, N, K // B):
                raise CheckpointError(
                    f"scales {src.where(scale_name)} have shape {list(s.shape)}; "
                    f"expected [{E}, {N}, {K // B}]"
                )
            scales = _checked_scales(e8m0_bytes(s, src.where(scale_name)), src.where(scale_name))
            out[proj] = (blocks[ids].reshape(len(ids), N, K // 2), scales[ids])

        def mats(pair, rows):
            w, s = pair
            return [
                CanonicalMatrix(w[i, rows].contiguous(), s[i, rows].contiguous().view(torch.float8_e8m0fnu))
                for i in range(len(ids))
            ]

        gate_rows, up_rows = _rows(ckpt)
        return mats(out["gate_up"], gate_rows), mats(out["gate_up"], up_rows), mats(out["down"], slice(None))

    def iter_native(self, ckpt: Checkpoint, layer: int, method: Method):
        yield from zip(*self.native(ckpt, layer, list(range(ckpt.spec.num_experts)), method), strict=True)

    def biases(self, ckpt: Checkpoint, layer: int, ids: list[int]) -> tuple:
        spec, src = ckpt.spec, ckpt.source
        E, I, H = spec.num_experts, spec.intermediate_size, spec.hidden_size
        found = {}
        for proj, N in (("gate_up", 2 * I), ("down", H)):
            name = _prefix(ckpt, layer, proj) + "_bias"
            found[proj] = None
            if src.has(name):
                b = src.tensor(name)
                if tuple(b.shape) != (E, N) or not b.dtype.is_floating_point:
                    raise CheckpointError(
                        f"{src.where(name)} is {b.dtype} {list(b.shape)}; expected float [{E}, {N}]"
                    )
                if not bool(torch.isfinite(b).all()):
                    raise CheckpointError(f"{src.where(name)} holds NaN or infinite values")
                found[proj] = b[ids].float()
        gb = found["gate_up"]
        gate_rows, up_rows = _rows(ckpt)
        if gb is None:
            return None, None, found["down"]
        return gb[:, gate_rows].contiguous(), gb[:, up_rows].contiguous(), found["down"]


def _prefix(ckpt: Checkpoint, layer: int, proj: str) -> str:
    pattern = ckpt.family.fused_mxfp4[proj]
    name = ckpt.source.resolve(pattern + "_blocks", layer=layer)
    if name is None:
        missing = pattern.format(layer=layer) + "_blocks"
        raise CheckpointError(f"tensor {missing} is missing from {ckpt.path} (layer {layer}'s MXFP4 experts)")
    return name.removesuffix("_blocks")


def _rows(ckpt: Checkpoint):
    """Rows of the fused gate_up tensor that hold gate and up."""
    I = ckpt.spec.intermediate_size
    if ckpt.family.fused_mxfp4.get("gate_up_rows", "interleaved") == "interleaved":
        return slice(0, None, 2), slice(1, None, 2)
    return slice(0, I), slice(I, None)


MXFP4 = Mxfp4Format()
FUSED_MXFP4 = FusedMxfp4Format()
