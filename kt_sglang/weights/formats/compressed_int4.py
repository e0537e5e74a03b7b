"""compressed-tensors ``pack-quantized`` INT4 (Kimi-K2-Thinking, K2.5): per linear ``weight_packed``
int32 ``[N, K/8]`` (8 nibbles along K, least significant first, value = nibble - 8), ``weight_scale``
bf16 ``[N, K/g]``, ``weight_shape`` ``[N, K]``; symmetric groups along K. Read as is by RAWINT4.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.formats._int4 import Int4Format, Int4Scheme, check_finite, config_error
from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.weights.checkpoint import Checkpoint


class CompressedInt4Format(Int4Format):
    name = "pack-quantized"
    packed = "weight_packed"

    def scheme(self, ckpt: Checkpoint, module: str) -> Int4Scheme:
        q = ckpt.quantization
        if q.get("quant_method") != "compressed-tensors" or q.get("format") != "pack-quantized":
            raise config_error(
                ckpt,
                f"is {q.get('quant_method')!r} / {q.get('format')!r}; {module} holds weight_packed, "
                "which needs compressed-tensors with format 'pack-quantized'",
            )
        weights = _weights_scheme(ckpt, module)
        if (
            weights.get("num_bits") != 4
            or weights.get("type", "int") != "int"
            or weights.get("strategy") != "group"
        ):
            raise config_error(
                ckpt,
                f"quantizes {module} with {weights.get('num_bits')}-bit {weights.get('type')} weights, "
                f"strategy {weights.get('strategy')!r}; RAWINT4 reads 4-bit int weights in groups",
            )
        if not weights.get("symmetric", False):
            raise config_error(
                ckpt,
                f"quantizes {module} asymmetrically (symmetric: false); RAWINT4 reads symmetric "
                "weights only (value = nibble - 8)",
            )
        if weights.get("actorder") not in (None, "weight"):
            raise config_error(
                ckpt,
                f"has actorder {weights.get('actorder')!r} for {module}: its groups are permuted along "
                "K, which RAWINT4 does not read; use a checkpoint quantized without activation order",
            )
        return Int4Scheme(self.group(ckpt, weights.get("group_size"), module), True)

    def read_matrix(
        self, ckpt: Checkpoint, base: str, scheme: Int4Scheme, shape: tuple[int, int]
    ) -> CanonicalMatrix:
        from kt_sglang.engine.canonical import CanonicalMatrix

        N, K = shape
        g = scheme.group
        what = f"a [{N}, {K}] weight, groups of {g}"
        if K % 8:
            raise CheckpointError(f"{base}: K = {K} is not a multiple of 8, as weight_packed needs")
        shape_t = self.tensor(ckpt, base, "weight_shape", (torch.int32, torch.int64), (2,), what)
        if [int(v) for v in shape_t] != [N, K]:
            raise CheckpointError(
                f"{ckpt.source.where(base + '.weight_shape')} says {[int(v) for v in shape_t]}; "
                f"the model's config needs [{N}, {K}]"
            )
        packed = self.tensor(ckpt, base, "weight_packed", (torch.int32,), (N, K // 8), what)
        scales = self.tensor(ckpt, base, "weight_scale", (torch.bfloat16,), (N, -(-K // g)), what)
        check_finite(ckpt, base + ".weight_scale", scales)
        # int32 little-endian: byte j holds nibbles 2j (low) and 2j + 1 (high), as canonical
        return CanonicalMatrix(packed.contiguous().view(torch.uint8).reshape(N, K // 2), scales.contiguous())


def _weights_scheme(ckpt: Checkpoint, module: str) -> dict:
    """The ``weights`` scheme of the config group that targets ``module``, unless it is ignored."""
    q = ckpt.quantization
    for pattern in q.get("ignore") or []:
        if _matches(pattern, module):
            raise config_error(
                ckpt, f"ignores {module} (pattern {pattern!r}): the expert is not quantized there"
            )
    for name, group in (q.get("config_groups") or {}).items():
        for target in group.get("targets") or []:
            if target == "Linear" or _matches(target, module):
                weights = group.get("weights")
                if not weights:
                    raise config_error(ckpt, f"group {name!r} has no weights scheme")
                return weights
    raise config_error(ckpt, f"has no config_groups entry whose targets match {module}")


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


PACK_QUANTIZED = CompressedInt4Format()
