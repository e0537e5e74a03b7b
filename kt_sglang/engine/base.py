"""What both modes of a layer's CPU experts share: the configuration, the native layer on the
process's pools, loading weights into it, the check of a forward's inputs, and its lifetime.

The inference layer (engine/inference.py) and the fine-tuning layer (engine/sft.py) build on
`BaseMoEWrapper`; `KTMoEWrapper(..., mode=...)` (engine/wrapper.py) picks one.
"""

from __future__ import annotations

import atexit
import weakref

import numpy as np
import torch

from kt_sglang.engine.activation import SILU, Glu
from kt_sglang.engine.canonical import CanonicalMatrix, check_matrix
from kt_sglang.engine.config import MoEConfig
from kt_sglang.engine.methods import METHODS, resolve_group
from kt_sglang.engine.native import NATIVE_DTYPES, _native
from kt_sglang.engine.pools import SharedRunner, plan_pools, selected_isa
from kt_sglang.engine.weight_source import LayerMethods, WeightSource, open_source


def contiguous_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype``, itself when it is one."""
    # Tested first: on the decode path every torch call costs microseconds on cold caches.
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


class BaseMoEWrapper:
    """The CPU experts of one MoE layer, built from a `MoEConfig`.

    The configuration's fields read as the layer's attributes (kt-kernel's names), except those the
    layer resolves against its weights and the machine: ``method``, ``group_size``, ``down_method``,
    ``down_group_size``, ``isa``, ``activation`` (and ``layout``, the pools' placement); ``config``
    keeps what was asked, ``source`` is the `WeightSource` at ``weight_path`` (None without one).
    ``gpu_experts_mask`` starts as the configuration's.
    """

    # Every live layer of the process: drained at exit, before the buffers their tasks read go away.
    _layers: weakref.WeakSet[BaseMoEWrapper] = weakref.WeakSet()

    def __init__(self, config: MoEConfig) -> None:
        self.config = config
        self.source: WeightSource | None = None
        methods = LayerMethods(config.method, None)
        if config.weight_path is not None:
            self.source = open_source(config.weight_path)
            methods = self.source.layer_methods(config)
        self.method = methods.method
        group = config.group_size if config.group_size is not None else methods.group_size
        self.group_size = resolve_group(methods.method, group)
        self.down_method = methods.down_method or methods.method
        self.isa = selected_isa(config.isa)
        self.activation = config.activation if config.activation is not None else self._source_activation()
        self.layout = plan_pools(config.cpuinfer_threads, config.threadpool_count, config.numa_nodes)
        self._runner, workspace = SharedRunner.get(self.layout)
        # The experts the forward skips: the configuration's, until a caller sets another mask.
        self.gpu_experts_mask = mask = config.gpu_experts_mask
        self._layer = _native.MoeLayer(
            self._runner,
            workspace,
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            self.method.native,
            self.group_size,
            self.isa,
            config.chunked_prefill_size,
            self.activation.native_kind,
            self.activation.limit,
            self.activation.alpha,
            # the GPU's experts get no packed weights here (kt-kernel keeps a CPU copy of every one)
            mask.to(torch.uint8).tolist() if mask is not None else [],
            methods.down_method.native if methods.down_method is not None else None,
            methods.down_group_size or 0,
            methods.int8_input_per_row,
        )
        BaseMoEWrapper._layers.add(self)

    def _source_activation(self) -> Glu:
        """The source's activation, as load_weights will read it; plain SiLU without a source, or
        where the source cannot be read (load_weights names the problem)."""
        if self.source is None:
            return SILU
        try:
            return self.source.activation()
        except (OSError, ValueError):
            return SILU

    # The configuration's fields, as kt-kernel's wrapper names them.
    layer_idx = property(lambda self: self.config.layer_idx)
    num_experts = property(lambda self: self.config.num_experts)
    num_experts_per_tok = property(lambda self: self.config.num_experts_per_tok)
    hidden_size = property(lambda self: self.config.hidden_size)
    moe_intermediate_size = property(lambda self: self.config.moe_intermediate_size)
    # The down projection's group (a GGUF layer may store down in another type than gate/up)
    down_group_size = property(lambda self: self._layer.down_group)
    weight_path = property(lambda self: self.config.weight_path)
    chunked_prefill_size = property(lambda self: self.config.chunked_prefill_size)
    cpu_save = property(lambda self: self.config.cpu_save)
    max_deferred_experts_per_token = property(lambda self: self.config.max_deferred_experts_per_token)
    expert_lora_path = property(lambda self: self.config.expert_lora_path)

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
        gate: list[CanonicalMatrix | None],
        up: list[CanonicalMatrix | None],
        down: list[CanonicalMatrix | None],
        *,
        partial: bool = False,
    ) -> None:
        """Packs already-quantized canonical matrices (one per expert slot; see engine/canonical.py;
        None, or anything, for the experts of ``gpu_experts_mask``: they are not read). With
        ``partial``, a held slot given None in all three is left as it is: a layer loaded a few
        experts a call (every held slot must be loaded once before a forward)."""
        E, I, H = self.num_experts, self.moe_intermediate_size, self.hidden_size
        down_method, down_group = self.down_method, self.down_group_size
        skipped = [
            not self.holds(e) or (partial and gate[e] is None and up[e] is None and down[e] is None)
            for e in range(min(E, len(gate), len(up), len(down)))
        ]
        ptrs = {}
        for name, mats, method, group, N, K in (
            ("gate", gate, self.method, self.group_size, I, H),
            ("up", up, self.method, self.group_size, I, H),
            ("down", down, down_method, down_group, H, I),
        ):
            if len(mats) != E:
                raise ValueError(f"{name} has {len(mats)} matrices; num_experts is {E}")
            ptrs[name] = [
                (0, 0, 0) if skipped[e] else check_matrix(m, method, group, N, K, f"{name}[{e}]")
                for e, m in enumerate(mats)
            ]
        self._layer.load_canonical(ptrs["gate"], ptrs["up"], ptrs["down"], partial)

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

    def has_biases(self) -> bool:
        """Whether expert biases were loaded (load_biases)."""
        return any(r is not None for r in getattr(self, "_biases", ()))

    def load_weights(self, physical_to_logical_map: torch.Tensor | list[int] | None = None) -> None:
        """Loads this layer's experts from its source at ``weight_path`` (kt_sglang.weights.sources):
        a directory written by ``kt-sglang convert-cpu``, a GGUF model, or the Hugging Face checkpoint
        itself (bf16 / fp16 / fp32, FP8, INT4, MXFP4), quantized to ``method`` on load, or taken as it
        is by the method that reads its format (``METHODS[m].checkpoint_format``: FP8, RAWINT4,
        GPTQ_INT4, MXFP4). The layer's ``activation`` is the source's unless the constructor was given
        another, which is refused here; expert biases (gpt-oss) are loaded with the weights.

        Slot e takes the source's expert ``physical_to_logical_map[e]`` (identity by default); only
        the experts named are read.
        """
        if self.source is None:
            raise ValueError("load_weights needs weight_path; use load_weights_from_tensors for tensors")
        self.source.load(self, physical_to_logical_map)

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

    @property
    def packed_bytes(self) -> int:
        return self._layer.packed_bytes

    def packed_view(self) -> dict:
        """Where this layer's packed weights are (kt_sglang/kernels/packed.py decodes them): per pool
        its intermediate slice, the addresses of its gate/up and down bytes and their size per
        expert (expert e at ``address + storage[e] * bytes``; ``storage[e]`` -1: not held), the
        padded hidden size and the gate/up block. Valid while the layer lives."""
        return self._layer.packed_view()

    # The packed file layout (weights/packed_files.py): one expert's packed weights as one pool over
    # the whole intermediate dimension holds them.

    def packed_file_bytes(self) -> tuple[int, int]:
        """(gate/up bytes, down bytes) of one expert in the packed file layout."""
        return self._layer.file_gate_up_bytes, self._layer.file_down_bytes

    def export_packed(self, slot: int, gate_up: np.ndarray, down: np.ndarray) -> None:
        """Copies held slot ``slot``'s packed weights into uint8 buffers of packed_file_bytes()."""
        for name, buf, n in (
            ("gate_up", gate_up, self._layer.file_gate_up_bytes),
            ("down", down, self._layer.file_down_bytes),
        ):
            if (
                buf.dtype != np.uint8
                or buf.nbytes != n
                or not buf.flags.c_contiguous
                or not buf.flags.writeable
            ):
                raise ValueError(f"{name} must be a writable contiguous uint8 buffer of {n} bytes")
        self._layer.export_packed(slot, gate_up.ctypes.data, down.ctypes.data)

    def map_packed(
        self, path: str, gate_up_offset: int, down_offset: int, file_experts: int, slot_to_file: list[int]
    ) -> None:
        """Takes the held slots' weights from a packed file (slot e: the file's expert
        ``slot_to_file[e]``); with one pool the layer computes from the mapping itself."""
        self._layer.map_packed(path, gate_up_offset, down_offset, file_experts, slot_to_file)

    @property
    def mapped(self) -> bool:
        """Whether the layer computes from a memory-mapped packed file."""
        return self._layer.mapped

    # ----------------------------------------------------------------------------------------
    # A forward's inputs

    def _check_inputs(self, hidden_states, topk_ids, topk_weights, *, ids_checked_by_engine=False) -> int:
        """Checks the inputs' types and shapes and returns T. Host ids are range-checked here unless
        the caller hands them to an engine call that checks them before it enqueues."""
        config = self.config
        E, k, H = config.num_experts, config.num_experts_per_tok, config.hidden_size
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

    def _mask_ptr(self) -> int:
        return self.gpu_experts_mask.data_ptr() if self.gpu_experts_mask is not None else 0

    # ----------------------------------------------------------------------------------------
    # Lifetime: a pending task reads this layer's buffers, so they outlive it

    def drain(self) -> None:
        """Waits until every task this layer submitted has finished (without returning outputs)."""
        self._layer.drain()

    def __del__(self) -> None:
        if getattr(self, "_layer", None) is not None:
            try:
                self.drain()
            except Exception:  # a destructor cannot raise; the native layer drains again when freed
                pass

    @staticmethod
    def _drain_all() -> None:
        for layer in list(BaseMoEWrapper._layers):
            layer.drain()

    def __repr__(self) -> str:
        down = ""
        if self.down_method != self.method or self.down_group_size != self.group_size:
            down = f"down_method={self.down_method.value}, down_group={self.down_group_size}, "
        return (
            f"{type(self).__name__}(layer={self.layer_idx}, experts={self.num_experts}, top_k="
            f"{self.num_experts_per_tok}, hidden={self.hidden_size}, intermediate="
            f"{self.moe_intermediate_size}, method={self.method.value}, group={self.group_size}, {down}"
            f"isa={self.isa}, threads={self.layout.threads}, pools={self.layout.pools})"
        )


# At interpreter exit, pending tasks finish before modules (and the buffers they read) go away.
atexit.register(BaseMoEWrapper._drain_all)
