"""The checkpoint formats a layer's experts can be stored in, and the registry that tells which one a
layer has. Each module declares one format (or its layouts): its name, how it detects itself on a
layer, which methods take it as it is, how it reads experts and what it checks in the config
(``base.ExpertFormat``). A new format is a new module here and one line in ``FORMATS``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kt_sglang.weights.formats.base import ExpertFormat
from kt_sglang.weights.formats.compressed_int4 import PACK_QUANTIZED
from kt_sglang.weights.formats.dense import DENSE, FUSED_DENSE
from kt_sglang.weights.formats.fp8_block import FP8_BLOCK
from kt_sglang.weights.formats.fp8_channel import FP8_CHANNEL
from kt_sglang.weights.formats.gptq import GPTQ
from kt_sglang.weights.formats.mxfp4 import FUSED_MXFP4, MXFP4
from kt_sglang.weights.formats.nvfp4 import NVFP4

if TYPE_CHECKING:
    from kt_sglang.engine.methods import MethodInfo
    from kt_sglang.weights.checkpoint import Checkpoint

# Tried in this order; the first that detects itself on a layer reads it. The order matters where
# one format's tensors look like another's:
# - FUSED_MXFP4 first: the family declares gpt-oss's fused tensors, whatever else the layer holds.
# - NVFP4 before PACK_QUANTIZED and MXFP4: compressed-tensors' NVFP4 has a weight_packed, ModelOpt's
#   a uint8 .weight; only NVFP4 has a global scale.
# - the packed formats (INT4, MXFP4) before FP8 and DENSE, which look at a .weight's dtype only.
# - FP8_BLOCK before FP8_CHANNEL, which claims every other FP8 weight (and names missing scales).
# - DENSE last of the per-expert ones: it claims any .weight left (and names a dtype it cannot read).
# - FUSED_DENSE last: the family's fused bf16 tensors, for a layer with no per-expert ones.
FORMATS: tuple[ExpertFormat, ...] = (
    FUSED_MXFP4,
    NVFP4,
    PACK_QUANTIZED,
    GPTQ,
    MXFP4,
    FP8_BLOCK,
    FP8_CHANNEL,
    DENSE,
    FUSED_DENSE,
)


def detect(ckpt: Checkpoint, layer: int) -> ExpertFormat | None:
    """The format of the layer's experts; None when the layer holds none."""
    return next((f for f in FORMATS if f.detect(ckpt, layer)), None)


def serving(info: MethodInfo) -> list[ExpertFormat]:
    """The formats the method takes as they are."""
    return [f for f in FORMATS if f.serves(info)]


__all__ = ["FORMATS", "ExpertFormat", "detect", "serving"]
