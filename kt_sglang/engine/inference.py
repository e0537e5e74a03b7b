"""The inference layer of one MoE layer's CPU experts: its forward on host tensors, and the
stream-ordered submit / sync of CUDA inputs through pinned buffers, one set per captured batch size."""

from __future__ import annotations

import torch

from kt_sglang.engine.base import BaseMoEWrapper, contiguous_as
from kt_sglang.engine.buffers import BufferSet, HostBuffers
from kt_sglang.engine.config import MoEConfig
from kt_sglang.engine.native import _native
from kt_sglang.engine.stream_signal import stream_signal


class InferenceMoEWrapper(BaseMoEWrapper):
    """The CPU experts of one MoE layer, for inference: ``KTMoEWrapper(...)`` builds one."""

    # SGLang's captured decode batch sizes (set_capture_batch_sizes): each gets buffers of its own.
    _capture_batch_sizes: tuple[int, ...] = ()

    def __init__(self, config: MoEConfig) -> None:
        self._output_dtype = torch.bfloat16
        # Per submission stream: buffers, rows, whether cuda_stream was given, its CUDA handle.
        self._pending: dict[bool, tuple[HostBuffers, int, bool, int | None]] = {}
        super().__init__(config)
        stream_signal()  # on a GPU, the stream hand-over is probed here, before any graph capture
        # Two submission streams: the layer's immediate experts and its deferred ones (which run
        # while the next layer computes), each with its own buffers and at most one pending task.
        self._sets = self._new_buffer_sets()

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype of forward's output: bf16 (default), or fp32 for a caller that adds other
        partial sums to it and rounds once (the hybrid layer)."""
        return self._output_dtype

    @output_dtype.setter
    def output_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"output_dtype must be torch.bfloat16 or torch.float32, got {dtype}")
        if dtype == self._output_dtype:
            return
        if self._pending:
            raise RuntimeError(f"layer {self.layer_idx}: output_dtype changed with a forward pending")
        self.drain()
        captured = tuple(self._sets[False].by_size)
        self._output_dtype = dtype
        self._sets = self._new_buffer_sets()
        for bufs in self._sets.values():
            bufs.capture(captured)

    # ----------------------------------------------------------------------------------------
    # Forward

    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        cuda_stream=None,
    ) -> torch.Tensor:
        """Sum over each token's CPU experts of weight * expert(hidden); ``[T, H]`` in
        ``output_dtype``."""
        inputs = (hidden_states, topk_ids, topk_weights)
        if cuda_stream is None and all(
            isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in inputs
        ):
            return self._forward_host(hidden_states, topk_ids, topk_weights)
        self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
        return self.sync_forward(hidden_states, cuda_stream)

    def _forward_host(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """A forward on host tensors: the engine reads the inputs in place and writes a new output
        (no staging copies: at T=1 the copies and the clone cost more than a tenth of the layer)."""
        T = self._check_inputs(hidden_states, topk_ids, topk_weights, ids_checked_by_engine=True)
        x = contiguous_as(hidden_states, torch.bfloat16)
        ids = contiguous_as(topk_ids, topk_ids.dtype)
        weights = contiguous_as(topk_weights, torch.float32)
        out = torch.empty(T, self.config.hidden_size, dtype=self._output_dtype)
        if T == 0:  # empty tensors have no storage to hand over
            return out
        task = self._layer.submit_forward(
            T,
            0,
            x.data_ptr(),
            ids.data_ptr(),
            ids.dtype == torch.int64,
            weights.data_ptr(),
            self._mask_ptr(),
            out.data_ptr(),
            False,
            out.dtype == torch.float32,
        )
        self._runner.wait(task)
        return out

    def submit_forward(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        cuda_stream=None,
        *,
        deferred: bool = False,
        num_tokens: torch.Tensor | None = None,
    ) -> None:
        """Copies the inputs to host buffers and enqueues the layer; returns at once.

        ``deferred=True`` uses a second stream of buffers, so a layer can have its deferred experts
        pending while its immediate ones are submitted and synced.

        With ``cuda_stream`` (the current CUDA stream, as ``torch.cuda.Stream`` or its handle) every
        step is ordered on that stream and nothing waits on the host: the device-to-host copies,
        then the hand-over to the engine (a write of the buffers' `ready` word that the engine's
        signal thread sees, or a host function where the driver lacks stream memory operations:
        docs/hybrid-layer.md), the batch size read from pinned memory when the forward runs.
        ``num_tokens`` (an int32 tensor ``[1]`` on the inputs' device) is that batch size, all rows
        by default: a CUDA graph captured at one size replays for fewer tokens when the caller
        writes the count there. Without a CUDA driver the same path runs synchronously.
        """
        if deferred in self._pending:
            raise RuntimeError(f"layer {self.layer_idx}: submit_forward called twice without sync_forward")
        T = self._check_inputs(hidden_states, topk_ids, topk_weights)
        if num_tokens is not None and (
            not isinstance(num_tokens, torch.Tensor)
            or num_tokens.dtype != torch.int32
            or num_tokens.numel() != 1
        ):
            raise ValueError(f"num_tokens must be an int32 tensor of one element, got {num_tokens!r}")
        on_stream = cuda_stream is not None
        handle = self._stream_handle(cuda_stream, hidden_states) if on_stream else None
        buf = self._sets[deferred].for_tokens(T)
        buf.hidden[:T].copy_(hidden_states, non_blocking=on_stream)
        buf.ids[:T].copy_(topk_ids, non_blocking=on_stream)
        buf.weights[:T].copy_(topk_weights, non_blocking=on_stream)
        if on_stream:
            if num_tokens is None:
                num_tokens = torch.full((1,), T, dtype=torch.int32, device=hidden_states.device)
            buf.tokens.copy_(num_tokens.reshape(1), non_blocking=True)
        else:
            if hidden_states.is_cuda:
                torch.cuda.current_stream().synchronize()
            rows = T if num_tokens is None else int(num_tokens.reshape(-1)[0])
            if not 0 <= rows <= T:
                raise ValueError(f"num_tokens is {rows}; the batch has {T} rows")
            buf.tokens.fill_(rows)
        # Without a CUDA handle (no stream, or CPU tensors) the host functions run at once: the
        # layer is enqueued now and runs on the pools while the caller goes on.
        self._stream_forward(buf).submit(handle)
        self._pending[deferred] = (buf, T, on_stream, handle)

    def sync_forward(
        self, hidden_states: torch.Tensor | None = None, cuda_stream=None, *, deferred: bool = False
    ) -> torch.Tensor:
        """Waits for this layer's submitted forward and returns its output (on the input's device).

        After a stream-ordered submit the wait is a host function on ``cuda_stream`` too, and the
        copy back to the device follows it on that stream.
        """
        if deferred not in self._pending:
            raise RuntimeError(f"layer {self.layer_idx}: sync_forward without submit_forward")
        buf, T, on_stream, submitted_on = self._pending[deferred]
        handle = self._stream_handle(cuda_stream, hidden_states) if cuda_stream is not None else None
        if on_stream and (cuda_stream is None or (submitted_on is not None and handle is None)):
            raise RuntimeError(
                f"layer {self.layer_idx}: submitted with cuda_stream; pass the same cuda_stream and the "
                "CUDA hidden_states to sync_forward"
            )
        del self._pending[deferred]
        buf.stream_forward.sync(handle)
        device = hidden_states.device if hidden_states is not None else torch.device("cpu")
        out = buf.out[:T]
        return out.to(device, non_blocking=True) if device.type != "cpu" else out.clone()

    def _stream_handle(self, cuda_stream, tensor: torch.Tensor | None) -> int | None:
        """The raw handle of ``cuda_stream`` for CUDA inputs, which must be torch's current stream
        (the copies are issued there); None for CPU inputs: the host functions then run at once."""
        if tensor is None or not tensor.is_cuda:
            return None
        handle = int(getattr(cuda_stream, "cuda_stream", cuda_stream))
        if handle != torch.cuda.current_stream(tensor.device).cuda_stream:
            raise ValueError(
                f"layer {self.layer_idx}: cuda_stream {handle:#x} is not the current stream of "
                f"{tensor.device}; call inside `with torch.cuda.stream(...)`"
            )
        return handle

    def _stream_forward(self, buf: HostBuffers):
        if buf.stream_forward is None:
            buf.stream_forward = _native.StreamForward(
                self._layer,
                self._runner,
                buf.tokens.data_ptr(),
                buf.capacity,
                buf.hidden.data_ptr(),
                buf.ids.data_ptr(),
                True,
                buf.weights.data_ptr(),
                self._mask_ptr(),
                buf.out.data_ptr(),
                buf.out.dtype == torch.float32,
                buf.signal.data_ptr(),
            )
        return buf.stream_forward

    def drain(self) -> None:
        """Waits until every forward this layer submitted has finished (without returning outputs)."""
        if any(on_stream for _, _, on_stream, _ in self._pending.values()) and torch.cuda.is_available():
            torch.cuda.synchronize()  # a stream-ordered submit enqueues from a host function
        super().drain()
        self._pending.clear()

    # ----------------------------------------------------------------------------------------
    # Batch-size buffers (kt-kernel's static API, which KTMoEWrapper hands on)

    def _new_buffer_sets(self) -> dict[bool, BufferSet]:
        """One set per submission stream: immediate (False) and deferred (True) experts."""
        return {
            deferred: BufferSet(self.hidden_size, self.num_experts_per_tok, self._output_dtype)
            for deferred in (False, True)
        }

    @staticmethod
    def _live_layers() -> list[InferenceMoEWrapper]:
        return [w for w in BaseMoEWrapper._layers if isinstance(w, InferenceMoEWrapper)]

    @staticmethod
    def set_capture_batch_sizes(batch_sizes: list[int]) -> None:
        """Batch sizes that get buffers of their own (SGLang's captured decode sizes)."""
        sizes = tuple(sorted({int(b) for b in batch_sizes}))
        if any(b < 1 for b in sizes):
            raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
        InferenceMoEWrapper._capture_batch_sizes = sizes
        for w in InferenceMoEWrapper._live_layers():
            for bufs in w._sets.values():
                bufs.capture(sizes)

    @staticmethod
    def get_capture_batch_sizes() -> list[int]:
        return list(InferenceMoEWrapper._capture_batch_sizes)

    @staticmethod
    def clear_buffer_cache() -> None:
        for w in InferenceMoEWrapper._live_layers():
            w._sets = w._new_buffer_sets()
