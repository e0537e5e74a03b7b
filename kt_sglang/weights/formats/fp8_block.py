"""FP8 with block scales: e4m3 weights and one fp32/bf16/fp16 scale per ``bn x bk`` block
(``quantization_config.weight_block_size``, 128 x 128 when it does not say), named
``{weight}_scale_inv`` (DeepSeek-V3/R1, Qwen3-FP8, MiniMax-M2) or ``{weight}_scale`` of the block
shape (compressed-tensors). Read as is by FP8; dequantized for the methods that quantize.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.formats._fp8 import Fp8Format
from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.methods import Method
    from kt_sglang.weights.checkpoint import Checkpoint


class Fp8BlockFormat(Fp8Format):
    block_scales = True
    what = "block scales"
    method_scales = "N/group,K/group"

    def check_config(self, ckpt: Checkpoint, method: Method, block: int) -> None:
        found = ckpt.quantization.get("weight_block_size")
        if found is not None and [int(v) for v in found] != [block, block]:
            raise CheckpointError(
                f"{ckpt.path / 'config.json'}: quantization_config.weight_block_size is {list(found)}; "
                f"{method.value}'s blocks are {block} x {block} (a method that quantizes reads this "
                "checkpoint: it dequantizes it first)"
            )

    def layout(self, scale: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> torch.Tensor | None:
        (bn, bk) = block
        if tuple(scale.shape) != (-(-N // bn), -(-K // bk)):
            return None
        return scale.float().contiguous()

    def expected(self, N: int, K: int, block: tuple[int, int]) -> str:
        (bn, bk) = block
        return f"[{-(-N // bn)}, {-(-K // bk)}] (one per {bn} x {bk} block"

    def expand(self, scales: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> torch.Tensor:
        (bn, bk) = block
        return scales.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]


FP8_BLOCK = Fp8BlockFormat()
