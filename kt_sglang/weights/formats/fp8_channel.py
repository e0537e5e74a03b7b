"""FP8 with one scale per output channel: e4m3 weights and a ``{weight}_scale`` of ``[N]`` or
``[N, 1]`` (compressed-tensors' channel strategy), or one scale for the whole tensor (repeated over
the channels). Read as is by FP8_PERCHANNEL; dequantized for the methods that quantize.
"""

from __future__ import annotations

import torch

from kt_sglang.weights.formats._fp8 import Fp8Format


class Fp8ChannelFormat(Fp8Format):
    block_scales = False
    what = "one scale per output channel"
    method_scales = "N"

    def layout(self, scale: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> torch.Tensor | None:
        if tuple(scale.shape) in ((N,), (N, 1)):
            return scale.float().reshape(N).contiguous()
        if scale.numel() == 1 and scale.dim() <= 1:  # one scale for the whole tensor
            return scale.float().reshape(1).expand(N).contiguous()
        return None

    def expected(self, N: int, K: int, block: tuple[int, int]) -> str:
        return f"[{N}] or [{N}, 1] (one per output channel"

    def expand(self, scales: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> torch.Tensor:
        return scales[:, None]


FP8_CHANNEL = Fp8ChannelFormat()
