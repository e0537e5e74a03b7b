"""KTMoEWrapper: the CPU experts of one MoE layer, call-compatible with kt-kernel's wrapper."""

from __future__ import annotations

import atexit
import weakref

import torch

from kt_sglang.engine.activation import SILU, Glu
from kt_sglang.engine.buffers import BufferSet, HostBuffers
from kt_sglang.engine.canonical import CanonicalMatrix, check_matrix
from kt_sglang.engine.methods import METHODS, parse_method, resolve_group
from kt_sglang.engine.native import NATIVE_DTYPES, _native
from kt_sglang.engine.pools import SharedRunner, plan_pools, selected_isa

# What the engine's sizes hold (expert ids are int32 there); far past any model's.
_MAX_EXPERTS = 2**31 - 1
_MAX_DIM = 2**31 - 1


def _contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Tested first: on the decode path every torch call costs microseconds on cold caches.
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


class KTMoEWrapper:
    """The CPU experts of one MoE layer.

    Parameters follow kt-kernel's ``KTMoEWrapper`` so that only the import changes
    (``cpu_save`` and ``max_deferred_experts_per_token`` are kept for callers; deferral belongs to the
    hybrid layer, which reads them from here). Our extras:
    ``group_size`` (quantization group; default: what a converted ``weight_path`` records, else the
    method's own) and ``isa`` (kernel family; default
    ``KT_SGLANG_ISA`` or the best the CPU runs).
    """

    _capture_batch_sizes: tuple[int, ...] = ()
    _instances: weakref.WeakSet[KTMoEWrapper] = weakref.WeakSet()
    # mode -> class; the fine-tuning module adds "sft" when the package imports it (it builds on
    # this class, so this module does not import it)
    _modes: dict[str, type[KTMoEWrapper]] = {}

    def __new__(cls, *args, mode: str = "inference", **kwargs):
        """``mode="sft"`` builds the fine-tuning layer (kt_sglang.engine.sft.SFTMoEWrapper)."""
        modes = {"inference": KTMoEWrapper, **KTMoEWrapper._modes}
        if mode not in modes:
            supported = ", ".join(repr(m) for m in modes)
            raise ValueError(f"Unknown mode: {mode!r}. Supported modes: {supported}")
        return super().__new__(modes[mode] if cls is KTMoEWrapper else cls)

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        gpu_experts_mask: torch.Tensor | None,
        cpuinfer_threads: int,
        threadpool_count: int,
        weight_path: str | None = None,
        chunked_prefill_size: int = 4096,
        cpu_save: bool = False,
        max_deferred_experts_per_token: int | None = None,
        method: str = "AMXINT4",
        numa_nodes: list[int] | None = None,
        group_size: int | None = None,
        isa: str | None = None,
        activation: Glu | None = None,
        mode: str = "inference",
        expert_lora_path: str | None = None,
    ) -> None:
        if mode != "inference":
            raise ValueError(
                f"mode={mode!r}: this is the inference layer; KTMoEWrapper(..., mode='sft') builds the other"
            )
        for name, value, largest in (
            ("num_experts", num_experts, _MAX_EXPERTS),
            ("num_experts_per_tok", num_experts_per_tok, _MAX_EXPERTS),
            ("hidden_size", hidden_size, _MAX_DIM),
            ("moe_intermediate_size", moe_intermediate_size, _MAX_DIM),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value > largest:
                raise ValueError(f"{name}={value} is larger than the engine takes (at most {largest})")
        if num_experts_per_tok > num_experts:
            raise ValueError(
                f"num_experts_per_tok={num_experts_per_tok} is larger than num_experts={num_experts}"
            )
        if not isinstance(chunked_prefill_size, int) or chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be a positive integer, got {chunked_prefill_size!r}")
        self.layer_idx = layer_idx
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.hidden_size = hidden_size
        self.moe_intermediate_size = moe_intermediate_size
        self.weight_path = weight_path
        self.chunked_prefill_size = chunked_prefill_size
        self.cpu_save = cpu_save
        self.max_deferred_experts_per_token = max_deferred_experts_per_token
        self.method = parse_method(method)
        if group_size is None and weight_path is not None:
            from kt_sglang.weights.layer_loader import recorded_group

            group_size = recorded_group(weight_path, self.method)
        self.group_size = resolve_group(self.method, group_size)
        self.isa = selected_isa(isa)
        if activation is None:  # the checkpoint's, as load_weights will read it; else plain SiLU
            from kt_sglang.weights.layer_loader import checkpoint_activation

            activation = checkpoint_activation(weight_path) if weight_path is not None else SILU
        self.gpu_experts_mask = self._check_mask(gpu_experts_mask)
        self.layout = plan_pools(cpuinfer_threads, threadpool_count, numa_nodes)
        self._runner, workspace = SharedRunner.get(self.layout)
        self._layer = _native.MoeLayer(
            self._runner,
            workspace,
            num_experts,
            num_experts_per_tok,
            hidden_size,
            moe_intermediate_size,
            self.method.native,
            self.group_size,
            self.isa,
            chunked_prefill_size,
            activation.native_kind,
            activation.limit,
            activation.alpha,
            # the GPU's experts get no packed weights here (kt-kernel keeps a CPU copy of every one)
            self.gpu_experts_mask.to(torch.uint8).tolist() if self.gpu_experts_mask is not None else [],
        )
        self.activation = activation
        self.expert_lora_path = expert_lora_path
        self._output_dtype = torch.bfloat16
        # Two submission streams: the layer's immediate experts and its deferred ones (which run
        # while the next layer computes), each with its own buffers and at most one pending task.
        self._sets = self._new_buffer_sets()
        # Per submission stream: buffers, rows, whether cuda_stream was given, its CUDA handle.
        self._pending: dict[bool, tuple[HostBuffers, int, bool, int | None]] = {}
        KTMoEWrapper._instances.add(self)

    # ----------------------------------------------------------------------------------------
    # Weights

    def load_weights_from_tensors(
        self,
        gate_proj: torch.Tensor,
        up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        physical_to_logical_map: torch.Tensor | list[int] | None = None,
        *,
        partial: bool = False,
    ) -> None:
        """Quantizes (per ``method``) and packs dense expert weights on the pools.

        gate_proj, up_proj: ``[E_src, I, H]``; down_proj: ``[E_src, H, I]``; bf16, fp16 or fp32,
        contiguous, on the CPU. Slot e takes source expert ``physical_to_logical_map[e]``; the slots of
        ``gpu_experts_mask`` are neither read nor held. With ``partial``, a map entry of -1 leaves its
        slot as it is: a layer loaded a few experts a call (every held slot must be loaded once before
        a forward).
        """
        E, I, H = self.num_experts, self.moe_intermediate_size, self.hidden_size
        info = METHODS[self.method]
        if not info.quantizes_dense:
            raise ValueError(
                f"{self.method.value} takes its experts' values from {info.checkpoint_format} "
                "checkpoints as they are (weight_path, or load_canonical), not from dense tensors; "
                "the engine quantizes dense weights to "
                + ", ".join(m.value for m, i in METHODS.items() if i.quantizes_dense)
            )
        tensors = {"gate_proj": gate_proj, "up_proj": up_proj, "down_proj": down_proj}
        dtype = gate_proj.dtype if isinstance(gate_proj, torch.Tensor) else None
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in NATIVE_DTYPES:
                raise ValueError(f"{name} has dtype {t.dtype}; expected bfloat16, float16 or float32")
            if t.dtype != dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but gate_proj has {dtype}; use one dtype")
            if t.device.type != "cpu":
                raise ValueError(f"{name} is on {t.device}; expert weights must be CPU tensors")
            if not t.is_contiguous():
                raise ValueError(f"{name} is not contiguous; call .contiguous() first")
        source_experts = gate_proj.shape[0] if gate_proj.dim() == 3 else -1
        for name, t, shape in (
            ("gate_proj", gate_proj, (source_experts, I, H)),
            ("up_proj", up_proj, (source_experts, I, H)),
            ("down_proj", down_proj, (source_experts, H, I)),
        ):
            if tuple(t.shape) != shape or source_experts < 1:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; expected [E_src, {shape[1]}, {shape[2]}] "
                    f"(with E_src >= 1 the same for all three)"
                )
        slots = self.slot_map(physical_to_logical_map, source_experts, partial)
        if not slots and source_experts < E:
            raise ValueError(
                f"the tensors hold {source_experts} experts but num_experts={E}; pass "
                "physical_to_logical_map to say which expert fills each slot"
            )
        self._layer.load_dense(
            gate_proj.data_ptr(),
            up_proj.data_ptr(),
            down_proj.data_ptr(),
            NATIVE_DTYPES[dtype],
            source_experts,
            slots,
        )

    def load_canonical(
        self,
        gate: list[CanonicalMatrix],
        up: list[CanonicalMatrix],
        down: list[CanonicalMatrix],
    ) -> None:
        """Packs already-quantized canonical matrices (one per expert slot; see engine/canonical.py;
        None, or anything, for the experts of ``gpu_experts_mask``: they are not read)."""
        E, I, H = self.num_experts, self.moe_intermediate_size, self.hidden_size
        ptrs = {}
        for name, mats, N, K in (("gate", gate, I, H), ("up", up, I, H), ("down", down, H, I)):
            if len(mats) != E:
                raise ValueError(f"{name} has {len(mats)} matrices; num_experts is {E}")
            ptrs[name] = [
                (0, 0, 0)
                if not self.holds(e)
                else check_matrix(m, self.method, self.group_size, N, K, f"{name}[{e}]")
                for e, m in enumerate(mats)
            ]
        self._layer.load_canonical(ptrs["gate"], ptrs["up"], ptrs["down"])

    def load_biases(
        self,
        gate_bias: torch.Tensor | None,
        up_bias: torch.Tensor | None,
        down_bias: torch.Tensor | None,
        physical_to_logical_map: torch.Tensor | list[int] | None = None,
    ) -> None:
        """Expert biases (gpt-oss): gate_bias, up_bias ``[E_src, I]`` added before the activation,
        down_bias ``[E_src, H]`` to each expert's output before its routing weight; any may be None.
        Slot e takes source expert ``physical_to_logical_map[e]``."""
        E, I, H = self.num_experts, self.moe_intermediate_size, self.hidden_size
        rows = []
        for name, t, width in (
            ("gate_bias", gate_bias, I),
            ("up_bias", up_bias, I),
            ("down_bias", down_bias, H),
        ):
            if t is None:
                rows.append(None)
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != width or t.shape[0] < 1:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} is {shape}; expected [E_src, {width}]")
            if not t.dtype.is_floating_point or t.device.type != "cpu":
                raise ValueError(f"{name} must be a floating-point CPU tensor, got {t.dtype} on {t.device}")
            slots = self.slot_map(physical_to_logical_map, t.shape[0])
            if not slots and t.shape[0] < E:
                raise ValueError(f"{name} holds {t.shape[0]} experts but num_experts={E}")
            rows.append((t[slots] if slots else t[:E]).float().contiguous())
        self._biases = rows  # kept alive: the engine copies them, the reference may read them
        self._layer.load_biases(*(0 if r is None else r.data_ptr() for r in rows))

    def load_weights(self, physical_to_logical_map: torch.Tensor | list[int] | None = None) -> None:
        """Loads this layer's experts from ``weight_path``: a canonical directory written by
        ``kt-sglang convert-cpu``, or the Hugging Face checkpoint itself (bf16 / fp16 / fp32, FP8,
        INT4, MXFP4), quantized to ``method`` on load, or taken as it is by the method that reads its
        format (``METHODS[m].checkpoint_format``: FP8, RAWINT4, GPTQ_INT4, MXFP4). The layer's
        ``activation`` is the checkpoint's unless the constructor was given another, which is refused
        here; expert biases (gpt-oss) are loaded with the weights.

        Slot e takes checkpoint expert ``physical_to_logical_map[e]`` (identity by default); only the
        experts named are read.
        """
        from kt_sglang.weights.layer_loader import load_layer

        if not self.weight_path:
            raise ValueError("load_weights needs weight_path; use load_weights_from_tensors for tensors")
        load_layer(self, physical_to_logical_map)

    def holds(self, expert: int) -> bool:
        """Whether this layer holds (packs, computes) expert slot ``expert``: not one of the GPU's."""
        return self.gpu_experts_mask is None or not bool(self.gpu_experts_mask[expert])

    def slot_map(self, physical_to_logical_map, source_experts: int, partial: bool = False) -> list[int]:
        """``partial``: -1 entries are allowed (slots this call leaves as they are)."""
        if physical_to_logical_map is None:
            return []
        slots = [int(v) for v in torch.as_tensor(physical_to_logical_map).reshape(-1).tolist()]
        if len(slots) != self.num_experts:
            raise ValueError(
                f"physical_to_logical_map has {len(slots)} entries; num_experts is {self.num_experts}"
            )
        bad = [s for s in slots if not (0 <= s < source_experts or (partial and s == -1))]
        if bad:
            raise ValueError(
                f"physical_to_logical_map names experts {bad[:4]} outside the {source_experts} given"
            )
        return slots

    # ----------------------------------------------------------------------------------------
    # Forward

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
        x = _contiguous(hidden_states, torch.bfloat16)
        ids = _contiguous(topk_ids, topk_ids.dtype)
        weights = _contiguous(topk_weights, torch.float32)
        out = torch.empty(T, self.hidden_size, dtype=self._output_dtype)
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
        then a host function that enqueues the layer, reading the batch size from pinned memory when
        it runs. ``num_tokens`` (an int32 tensor ``[1]`` on the inputs' device) is that batch size,
        all rows by default: a CUDA graph captured at one size replays for fewer tokens when the
        caller writes the count there. Without a CUDA driver the same path runs synchronously.
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
            )
        return buf.stream_forward

    def _mask_ptr(self) -> int:
        return self.gpu_experts_mask.data_ptr() if self.gpu_experts_mask is not None else 0

    def _check_inputs(self, hidden_states, topk_ids, topk_weights, *, ids_checked_by_engine=False) -> int:
        """Checks the inputs' types and shapes and returns T. Host ids are range-checked here unless
        the caller hands them to an engine call that checks them before it enqueues."""
        E, k, H = self.num_experts, self.num_experts_per_tok, self.hidden_size
        for name, t in (
            ("hidden_states", hidden_states),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
        ):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if hidden_states.dim() != 2 or hidden_states.shape[1] != H:
            raise ValueError(f"hidden_states has shape {tuple(hidden_states.shape)}; expected [T, {H}]")
        if not hidden_states.dtype.is_floating_point:
            raise ValueError(f"hidden_states has dtype {hidden_states.dtype}; expected bfloat16")
        T = hidden_states.shape[0]
        if tuple(topk_ids.shape) != (T, k):
            raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}; expected [{T}, {k}]")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids has dtype {topk_ids.dtype}; expected int32 or int64")
        if tuple(topk_weights.shape) != (T, k):
            raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}; expected [{T}, {k}]")
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"topk_weights has dtype {topk_weights.dtype}; expected float32")
        if topk_ids.device.type == "cpu" and not ids_checked_by_engine:
            ids = topk_ids.contiguous()
            _native.check_expert_ids(ids.data_ptr(), ids.dtype == torch.int64, T, k, E)
        return T

    def _check_mask(self, mask) -> torch.Tensor | None:
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor):
            mask = torch.as_tensor(mask)
        if mask.dtype != torch.bool:
            raise ValueError(f"gpu_experts_mask has dtype {mask.dtype}; expected torch.bool")
        if tuple(mask.shape) != (self.num_experts,):
            raise ValueError(f"gpu_experts_mask has shape {tuple(mask.shape)}; expected [{self.num_experts}]")
        return mask.to("cpu").contiguous()

    def _new_buffer_sets(self) -> dict[bool, BufferSet]:
        """One set per submission stream: immediate (False) and deferred (True) experts."""
        return {
            deferred: BufferSet(self.hidden_size, self.num_experts_per_tok, self._output_dtype)
            for deferred in (False, True)
        }

    # ----------------------------------------------------------------------------------------
    # Batch-size buffers (kt-kernel's static API)

    @staticmethod
    def set_capture_batch_sizes(batch_sizes: list[int]) -> None:
        """Batch sizes that get buffers of their own (SGLang's captured decode sizes)."""
        sizes = tuple(sorted({int(b) for b in batch_sizes}))
        if any(b < 1 for b in sizes):
            raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
        KTMoEWrapper._capture_batch_sizes = sizes
        for w in KTMoEWrapper._instances:
            w._allocate_capture_buffers()

    @staticmethod
    def get_capture_batch_sizes() -> list[int]:
        return list(KTMoEWrapper._capture_batch_sizes)

    @staticmethod
    def clear_buffer_cache() -> None:
        for w in KTMoEWrapper._instances:
            w._sets = w._new_buffer_sets()

    def _allocate_capture_buffers(self) -> None:
        for bufs in self._sets.values():
            bufs.capture(KTMoEWrapper._capture_batch_sizes)

    # ----------------------------------------------------------------------------------------
    # Lifetime: a pending task reads this layer's buffers, so they outlive it

    def drain(self) -> None:
        """Waits until every forward this layer submitted has finished (without returning outputs)."""
        if any(on_stream for _, _, on_stream, _ in self._pending.values()) and torch.cuda.is_available():
            torch.cuda.synchronize()  # a stream-ordered submit enqueues from a host function
        self._layer.drain()
        self._pending.clear()

    def __del__(self) -> None:
        if getattr(self, "_layer", None) is not None:
            try:
                self.drain()
            except Exception:  # a destructor cannot raise; the native layer drains again when freed
                pass

    @staticmethod
    def _drain_all() -> None:
        for w in list(KTMoEWrapper._instances):
            w.drain()

    # ----------------------------------------------------------------------------------------

    @property
    def packed_bytes(self) -> int:
        return self._layer.packed_bytes

    def __repr__(self) -> str:
        return (
            f"KTMoEWrapper(layer={self.layer_idx}, experts={self.num_experts}, top_k="
            f"{self.num_experts_per_tok}, hidden={self.hidden_size}, intermediate="
            f"{self.moe_intermediate_size}, method={self.method.value}, group={self.group_size}, "
            f"isa={self.isa}, threads={self.layout.threads}, pools={self.layout.pools})"
        )


# At interpreter exit, pending tasks finish before modules (and the buffers they read) go away.
atexit.register(KTMoEWrapper._drain_all)
