"""Host buffers of the stream-ordered forward: inputs copied in, the output the engine writes.

Pinned when a GPU is present (the copies to and from the device are asynchronous). A layer keeps one
set per submission stream (immediate and deferred experts), each with a buffer per captured batch
size (a CUDA graph replays with the pointers it captured) and one reusable buffer for other sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kt_sglang.engine.native import _native


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t


@dataclass
class HostBuffers:
    """The buffers of one batch size."""

    hidden: torch.Tensor  # bf16 [T, H]
    ids: torch.Tensor  # int64 [T, k]
    weights: torch.Tensor  # fp32 [T, k]
    out: torch.Tensor  # bf16 or fp32 [T, H] (the layer's output_dtype)
    tokens: torch.Tensor  # int32 [1]: the batch size the task reads when it runs
    # int32 [StreamForward.SIGNAL_WORDS]: the words a CUDA stream and the engine hand the task over
    # with (ready: the inputs are in; done: the output is), on cache lines of their own
    signal: torch.Tensor
    stream_forward: object | None = None  # _native.StreamForward over these buffers, made on first use

    @classmethod
    def allocate(cls, tokens: int, hidden: int, top_k: int, out_dtype: torch.dtype) -> HostBuffers:
        return cls(
            _pin(torch.zeros(tokens, hidden, dtype=torch.bfloat16)),
            _pin(torch.zeros(tokens, top_k, dtype=torch.int64)),
            _pin(torch.zeros(tokens, top_k, dtype=torch.float32)),
            _pin(torch.zeros(tokens, hidden, dtype=out_dtype)),
            _pin(torch.zeros(1, dtype=torch.int32)),
            _pin(torch.zeros(_native.StreamForward.SIGNAL_WORDS, dtype=torch.int32)),
        )

    @property
    def capacity(self) -> int:
        return self.hidden.shape[0]


@dataclass
class BufferSet:
    """The buffers of one submission stream, for rows of ``hidden`` values and ``top_k`` experts."""

    hidden: int
    top_k: int
    out_dtype: torch.dtype
    by_size: dict[int, HostBuffers] = field(default_factory=dict)  # captured batch sizes
    spare: HostBuffers | None = None  # reused for every other size, grown as needed

    def for_tokens(self, tokens: int) -> HostBuffers:
        """The buffers for a batch: its captured size's, the smallest captured size that fits, or the
        spare one."""
        buf = self.by_size.get(tokens)
        if buf is not None:
            return buf
        for size in sorted(self.by_size):
            if size >= tokens:
                return self.by_size[size]
        if self.spare is None or self.spare.capacity < tokens:
            self.spare = HostBuffers.allocate(max(tokens, 1), self.hidden, self.top_k, self.out_dtype)
        return self.spare

    def capture(self, sizes: tuple[int, ...]) -> None:
        """Buffers of their own for these batch sizes (those already there are kept)."""
        for size in sizes:
            if size not in self.by_size:
                self.by_size[size] = HostBuffers.allocate(size, self.hidden, self.top_k, self.out_dtype)
