"""`KTEPWrapperMethod`: SGLang's MoE method for FusedMoE layers with CPU experts, on our engine.

It REPLACEs `sglang.srt.layers.moe.kt_ep_wrapper.KTEPWrapperMethod` (same name: SGLang's loader
checks the class name) with the same constructor `(gpu_method, kt_config)`. The hot experts of the
layer (any placement, not only ids 0..N-1) live in GPU slots of the wrapped method's weights; the
CPU engine holds and computes the cold ones (every expert with placement by heat, where the hot set
changes while serving: the layer then also keeps a pinned host copy of every expert's GPU weights,
from which moves refill its spare slots). The forward is the standalone
`HybridMoELayer`, whose hot path here is SGLang's GPU method (or, with `--device cpu`, the layer's
masked torch path: SGLang's CPU fallback crashes on -1 expert ids).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from kt_sglang.engine.activation import SILU, Glu
from kt_sglang.engine.inference import InferenceMoEWrapper
from kt_sglang.engine.wrapper import KTMoEWrapper
from kt_sglang.layer.hybrid import DEFERRAL_MAX_TOKENS, DeferralChain, HotExperts, HybridMoELayer
from kt_sglang.placement import (
    ExpertHeat,
    ExpertSlots,
    HeatPlacement,
    PlacementStats,
    StatsRecorder,
    plan_hot_experts,
    slot_map,
)
from kt_sglang.placement.heat import spare_slots
from kt_sglang.placement.strategies import expert_bytes
from kt_sglang.sglang.settings import KtSettings, model_facts

logger = logging.getLogger("kt_sglang")

_recorder: StatsRecorder | None = None  # one per worker process: the file is written as a whole


def settings_for(kt_config) -> KtSettings:
    """The launcher's resolved settings; for an embedded `sglang.Engine` (no launcher hook), the
    upstream flags as SGLang holds them, with our defaults."""
    settings = KtSettings.from_env()
    if settings is not None:
        return settings
    return KtSettings(
        weight_path=kt_config.weight_path,
        method=kt_config.method,
        cpuinfer=kt_config.cpuinfer_threads or 1,
        threadpool_count=kt_config.threadpool_count,
        num_gpu_experts=kt_config.num_gpu_experts,
        gpu_experts_ratio=None,
        max_deferred_experts_per_token=kt_config.max_deferred_experts_per_token or 0,
        numa_nodes=None,
        placement_strategy="uniform",
        placement_stats=None,
        record_placement_stats=None,
    )


def runner_activation(moe_runner_config) -> Glu:
    """SGLang's MoE activation (its MoeRunnerConfig) as the engine's: gpt-oss sets gemm1_alpha and
    gemm1_clamp_limit, DeepSeek-V4 swiglu_limit on a plain SiLU."""
    cfg = moe_runner_config
    if cfg.gemm1_alpha is not None:
        return Glu("swiglu_oai", float(cfg.gemm1_clamp_limit or 0.0), float(cfg.gemm1_alpha))
    if cfg.activation == "silu" and cfg.is_gated:
        return Glu("silu", float(cfg.swiglu_limit or cfg.gemm1_clamp_limit or 0.0))
    raise ValueError(
        f"kt-sglang CPU experts compute gated SiLU (with optional clamps) and gpt-oss's SwiGLU; MoE layer "
        f"{cfg.layer_id} uses {cfg.activation}{'' if cfg.is_gated else ' (not gated)'}: this model cannot "
        "use --kt-weight-path yet"
    )


def hot_experts_of_layer(
    settings: KtSettings, layer_idx: int, num_experts: int, one_expert_bytes: int
) -> list[int]:
    from sglang.srt.runtime_context import get_server_args

    facts = model_facts(get_server_args().model_path)
    moe_layers = facts.moe_layers if facts is not None else [layer_idx]
    if layer_idx not in moe_layers:
        moe_layers = sorted({*moe_layers, layer_idx})
    stats = PlacementStats.read(settings.placement_stats) if settings.placement_stats else None
    plan = plan_hot_experts(
        settings.placement_strategy,
        moe_layers,
        num_experts,
        settings.total_hot(num_experts, len(moe_layers), one_expert_bytes),
        stats,
    )
    return plan[layer_idx]


def heat_placement(methods: list[KTEPWrapperMethod], settings: KtSettings) -> HeatPlacement | None:
    """One model's placement by heat over its attached layers; None with another placement."""
    layers = [m.heat for m in methods if m.heat is not None]
    return HeatPlacement(settings.heat_config(), layers) if layers else None


class KTEPWrapperMethod(FusedMoEMethodBase):
    """SGLang's MoE method for one FusedMoE layer: hot experts through ``gpu_method``, cold ones on
    the CPU engine. With tensor parallelism SGLang shards the hot experts' weights as its own
    FusedMoE's, and only rank 0 holds and computes the cold experts (their whole intermediate
    dimension), added before SGLang's all-reduce: one copy in host memory, one engine on the cores."""

    def __init__(self, gpu_method: FusedMoEMethodBase, kt_config) -> None:
        from sglang.srt.runtime_context import get_parallel

        self.gpu_method = gpu_method
        self.kt_config = kt_config
        self.settings = settings_for(kt_config)
        self.layer_idx = kt_config.layer_idx
        self.tp_rank = get_parallel().tp_rank
        self.wrapper: InferenceMoEWrapper | None = None
        self.hybrid: HybridMoELayer | None = None
        self.hot_experts: list[int] = []
        self.gpu_slot_of: torch.Tensor | None = None
        self.num_hot = 0
        self.num_slots = 0  # the hot experts' and, with placement by heat, the spare ones
        # placement by heat: (GPU parameter, its host copy of every expert) per weight tensor
        self.host_weights: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] | None = None
        self.heat: tuple[ExpertHeat, ExpertSlots] | None = None  # set by attach()
        # SGLang's loader drops experts with id >= num_gpu_experts unless it is -1: our placement
        # decides instead (the _weight_loader_impl hook maps ids to slots).
        self.num_gpu_experts = -1
        self.max_deferred = self.settings.max_deferred_experts_per_token
        self.override_num_local_experts = True
        gpu_method.num_gpu_experts = 0

    # -- weights ---------------------------------------------------------------------------

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        self.global_num_experts = num_experts
        one = expert_bytes(hidden_size, intermediate_size_per_partition, params_dtype.itemsize)
        self.hot_experts = hot_experts_of_layer(self.settings, self.layer_idx, num_experts, one)
        self.gpu_slot_of = slot_map(self.hot_experts, num_experts)
        self.num_hot = len(self.hot_experts)
        by_heat = self.settings.placement_strategy == "heat"
        self.num_slots = self.num_hot + self.settings.spare_slots(self.num_hot, num_experts)
        self.gpu_method.num_gpu_experts = self.num_slots
        # Some GPU methods (SGLang's MXFP4 one, gpt-oss) size their weights by the layer's
        # num_local_experts, not by num_experts: they too hold the slots only.
        num_local_experts, layer.num_local_experts = layer.num_local_experts, self.num_slots
        try:
            self.gpu_method.create_weights(
                layer=layer,
                num_experts=self.num_slots,
                hidden_size=hidden_size,
                intermediate_size_per_partition=intermediate_size_per_partition,
                params_dtype=params_dtype,
                **extra_weight_attrs,
            )
        finally:
            layer.num_local_experts = num_local_experts
        if by_heat:
            self.host_weights = self._host_copies(layer, num_experts)
        if self.tp_rank == 0:
            s = self.settings
            self.wrapper = KTMoEWrapper(
                layer_idx=self.layer_idx,
                num_experts=num_experts,
                num_experts_per_tok=layer.top_k,
                hidden_size=hidden_size,
                moe_intermediate_size=layer.intermediate_size_per_partition * layer.moe_tp_size,
                # the hot experts are neither held nor read here, unless placement by heat may make
                # any of them cold
                gpu_experts_mask=None if by_heat else self.gpu_slot_of >= 0,
                cpuinfer_threads=s.cpuinfer,
                threadpool_count=s.threadpool_count,
                weight_path=s.weight_path,
                chunked_prefill_size=self.kt_config.chunked_prefill_size or 4096,
                max_deferred_experts_per_token=self.max_deferred,
                method=s.method,
                numa_nodes=s.numa_nodes,
                expert_lora_path=s.expert_lora_path,
            )
        if self.settings.record_placement_stats and self.tp_rank == 0:
            global _recorder
            if _recorder is None:
                _recorder = StatsRecorder(self.settings.record_placement_stats, num_experts)

    def _host_copies(
        self, layer: torch.nn.Module, num_experts: int
    ) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """Placement by heat: a host copy of every expert's GPU weights, filled by the loader hook.
        Only unquantized GPU experts (SGLang's UnquantizedFusedMoEMethod) are copied as loaded."""
        from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

        biases = [n for n in ("w13_weight_bias", "w2_weight_bias") if getattr(layer, n, None) is not None]
        if not isinstance(self.gpu_method, UnquantizedFusedMoEMethod) or biases:
            why = f"biases ({', '.join(biases)})" if biases else type(self.gpu_method).__name__
            raise ValueError(
                f"MoE layer {self.layer_idx}: --kt-expert-placement-strategy heat moves unquantized GPU "
                f"experts without biases (bf16 / fp16); this layer's have {why}: use another placement"
            )
        copies = []
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            host = torch.empty(
                (num_experts, *param.shape[1:]), dtype=param.dtype, pin_memory=torch.cuda.is_available()
            )
            twin = torch.nn.Parameter(host, requires_grad=False)
            twin.__dict__.update(param.__dict__)  # the loader's attributes (weight_loader, ...)
            copies.append((param, twin))
        return copies

    def host_copy_of(self, param: torch.nn.Parameter) -> torch.nn.Parameter | None:
        """The host copy of every expert that the loader fills beside ``param`` (heat only)."""
        for gpu, host in self.host_weights or ():
            if gpu is param:
                return host
        return None

    def gpu_slot(self, expert_id: int) -> int:
        """The loader's checkpoint expert id -> its GPU slot, -1 when the expert is cold."""
        return int(self.gpu_slot_of[expert_id]) if 0 <= expert_id < self.global_num_experts else -1

    def hot_rows(self, loaded: torch.Tensor) -> torch.Tensor:
        """A tensor of all the layer's experts (SGLang's MXFP4 loader hands gpt-oss's that way) ->
        the hot experts' rows, in slot order."""
        if loaded.shape[0] != self.global_num_experts:
            raise ValueError(
                f"MoE layer {self.layer_idx}: a tensor of all experts has {loaded.shape[0]} rows, the "
                f"layer {self.global_num_experts} experts (expert parallelism is not supported)"
            )
        return loaded[torch.tensor(self.hot_experts, dtype=torch.long, device=loaded.device)]

    def merge_hot_adapter(self, layer: torch.nn.Module) -> None:
        """Adds the expert adapter's scale * B A to the hot experts' weights as SGLang loaded them
        (w13 [hot, 2I, H]: gate rows, then up rows; w2 [hot, H, I])."""
        from kt_sglang.finetune.adapter import ExpertAdapter

        w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
        if w13 is None or w2 is None or not w13.dtype.is_floating_point or w13.dtype.itemsize < 2:
            raise ValueError(
                f"MoE layer {self.layer_idx}: --kt-expert-lora-path merges into unquantized GPU experts "
                "only; serve the hot experts in bf16 (or use --kt-num-gpu-experts 0)"
            )
        I, H = w2.shape[2], w2.shape[1]
        deltas = ExpertAdapter(self.settings.expert_lora_path).deltas(
            self.layer_idx, self.hot_experts, self.global_num_experts, H, I
        )
        if deltas is None:
            return
        gate, up, down = deltas
        with torch.no_grad():
            for e, g, u, d in zip(self.hot_experts, gate, up, down, strict=True):
                slot = self.gpu_slot(e)
                w13[slot] += torch.cat([g, u]).to(device=w13.device, dtype=w13.dtype)
                w2[slot] += d.to(device=w2.device, dtype=w2.dtype)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.settings.expert_lora_path and self.num_hot:
            self.merge_hot_adapter(layer)
        # With no hot experts the GPU method has nothing to process (SGLang's MXFP4 one would run a
        # Triton kernel on its empty weights).
        if self.num_hot and hasattr(self.gpu_method, "process_weights_after_loading"):
            self.gpu_method.process_weights_after_loading(layer)
        if self.wrapper is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        metadata = get_global_expert_location_metadata()
        mapping = None
        if metadata is not None:
            mapping = metadata.physical_to_logical_map_cpu[self.layer_idx].contiguous()
        self.wrapper.load_weights(mapping)

    def attach(self, layer: torch.nn.Module, chain: DeferralChain) -> None:
        """Builds the forward once the weights are final; the model's layers are then linked. A
        tensor-parallel rank other than 0 computes its share of the hot experts only: rank 0 adds
        all the cold experts, and SGLang's all-reduce after the layer sums the ranks."""
        self._check_hot_on_cpu(layer)
        w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
        if not self.num_slots or w13 is None or w2 is None:
            # None hot, or (on CUDA) the GPU method keeps them in a layout of its own (SGLang's
            # triton_kernels MXFP4 replaces both after loading): its apply() reads them, not ours.
            w13 = w2 = torch.zeros(self.num_slots, 0, 0)
        if self.wrapper is None:
            self.hybrid = HybridMoELayer(None, self.gpu_slot_of, w13, w2, chain)
            return
        limit = self.settings.deferral_max_batch
        self.hybrid = HybridMoELayer(
            self.wrapper,
            self.gpu_slot_of,
            w13,
            w2,
            chain,
            self.max_deferred,
            DEFERRAL_MAX_TOKENS if limit is None else limit,
        )
        if self.host_weights is not None:
            self._attach_heat(layer)

    def _attach_heat(self, layer: torch.nn.Module) -> None:
        """The layer's routing heat and its slots, refilled from the host copies (placement by heat)."""
        gpu = [getattr(layer, name).data for name in ("w13_weight", "w2_weight")]
        host = []
        for g, (_, twin) in zip(gpu, self.host_weights, strict=True):
            h = twin.data
            if g.dtype != h.dtype and g.dtype.is_floating_point and h.dtype.is_floating_point:
                h = h.to(g.dtype).pin_memory() if g.is_cuda else h.to(g.dtype)  # a model-wide .to(dtype)
            host.append(h)
            if g.shape[1:] != h.shape[1:] or g.dtype != h.dtype:
                raise ValueError(
                    f"MoE layer {self.layer_idx}: SGLang's GPU method changed its experts' layout after "
                    f"loading ({tuple(h.shape[1:])} {h.dtype} -> {tuple(g.shape[1:])} {g.dtype}): "
                    "--kt-expert-placement-strategy heat cannot refill its slots; use another placement"
                )
        self.hybrid.heat = ExpertHeat(self.global_num_experts, gpu[0].device)
        slot_of = self.hybrid.gpu_slot_of
        self.hybrid.slots = ExpertSlots(slot_of, gpu, host, spare_slots(slot_of, self.num_slots))
        self.heat = (self.hybrid.heat, self.hybrid.slots)

    def _check_hot_on_cpu(self, layer: torch.nn.Module) -> None:
        """On the CPU device the hot experts run the hybrid layer's torch path (plain SiLU, gate and
        up as halves, float weights, no biases), not SGLang's method: refuse what it cannot compute."""
        w13 = getattr(layer, "w13_weight", None)
        if (
            not self.num_hot
            or (w13 is not None and w13.is_cuda)
            or (w13 is None and torch.cuda.is_available())
        ):
            return
        reasons = []
        if w13 is None:
            reasons.append(
                f"the GPU method ({type(self.gpu_method).__name__}) keeps them in a layout of its own"
            )
        elif not w13.dtype.is_floating_point or w13.dtype.itemsize < 2:
            reasons.append(f"the GPU experts are quantized ({w13.dtype})")
        if self.wrapper is not None and self.wrapper.activation != SILU:
            reasons.append(f"the activation is {self.wrapper.activation}")
        if any(getattr(layer, name, None) is not None for name in ("w13_weight_bias", "w2_weight_bias")):
            reasons.append("the experts have biases")
        if reasons:
            raise ValueError(
                f"MoE layer {self.layer_idx}: hot experts on the CPU device run a plain SiLU MoE in torch, "
                f"but {' and '.join(reasons)}: use --kt-num-gpu-experts 0 with --device cpu"
            )

    # -- runner ----------------------------------------------------------------------------

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        found = runner_activation(moe_runner_config)  # at model build, not at the first request
        if self.wrapper is not None and found != self.wrapper.activation:
            raise ValueError(
                f"MoE layer {self.layer_idx}: SGLang's model computes the activation {found}, the experts "
                f"of --kt-weight-path {self.settings.weight_path} {self.wrapper.activation}: point it at "
                "this model's checkpoint"
            )
        self.moe_runner_config = moe_runner_config
        moe_runner_config.num_local_experts = self.num_slots
        # DeepSeek / GLM multiply the MoE output by routed_scaling_factor in the model when this
        # wrapper is active: the GPU runner must not apply it a second time.
        moe_runner_config.routed_scaling_factor = None
        self.gpu_method.create_moe_runner(layer, moe_runner_config)

    def get_moe_runner_backend(self, layer):
        return self.gpu_method.get_moe_runner_backend(layer)

    def get_moe_routing_method_type(self, layer, requested_method):
        return self.gpu_method.get_moe_routing_method_type(layer, requested_method)

    def apply(self, layer: torch.nn.Module, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        if TopKOutputChecker.format_is_bypassed(dispatch_output.topk_output):
            dispatch_output = dispatch_output._replace(topk_output=dispatch_output.topk_output.to_standard())
        x = dispatch_output.hidden_states
        topk = dispatch_output.topk_output
        if self.hybrid is None:
            raise RuntimeError(f"kt-sglang: MoE layer {self.layer_idx} ran before its weights were attached")
        if _recorder is not None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            _recorder.add(self.layer_idx, topk.topk_ids)
        # On the CPU device the hybrid layer computes the hot experts itself (torch, checked by
        # _check_hot_on_cpu); on a GPU, SGLang's method does.
        hot = self._sglang_hot_experts(layer, dispatch_output) if x.is_cuda else None
        out = self.hybrid(x, topk.topk_ids, topk.topk_weights, hot=hot)
        return StandardCombineInput(hidden_states=out)

    def _sglang_hot_experts(self, layer: torch.nn.Module, dispatch_output) -> HotExperts:
        """The hot experts through SGLang's wrapped GPU method, with the slots as its expert ids."""

        def hot(hidden: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            if self.num_slots == 0:
                return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            topk = dispatch_output.topk_output
            hot_topk = topk._replace(topk_ids=slot_ids.to(topk.topk_ids.dtype))
            out = self.gpu_method.apply(layer, dispatch_output._replace(topk_output=hot_topk))
            return out.hidden_states.float()

        return hot

    def __getattr__(self, name: str):
        # SGLang reads the wrapped method's attributes through the wrapper (as upstream's does).
        if name in ("gpu_method", "wrapper", "kt_config", "settings", "hybrid", "host_weights", "heat"):
            raise AttributeError(name)
        return getattr(self.gpu_method, name)
