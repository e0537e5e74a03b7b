"""The `--kt-*` settings: SGLang's own flags, ours, their defaults and their validation.

SGLang declares `--kt-weight-path --kt-method --kt-cpuinfer --kt-threadpool-count
--kt-num-gpu-experts --kt-max-deferred-experts-per-token` and validates none of them. Our extra
flags are taken out of argv before SGLang parses it. Everything is resolved once, in the launcher,
into one `KtSettings`, validated against the model and the machine, and handed to the worker
processes through the environment (spawned workers inherit it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kt_sglang.engine.weight_source import WeightSource
    from kt_sglang.placement.heat import HeatConfig

ENV_VAR = "KT_SGLANG_SETTINGS"
# --kt-heat-<field> for each field of placement.heat.HeatConfig (its defaults and checks are the flags')
HEAT_FLAG_PREFIX = "--kt-heat-"
HEAT_HELP = {
    "half_life_steps": "placement by heat: forward steps after which a routed selection counts half",
    "margin": "placement by heat: a cold expert replaces a hot one when (1 + margin) times as hot, "
    "plus one selection",
    "interval_steps": "placement by heat: forward steps between two re-choices of the hot set",
    "max_moves": "placement by heat: experts moved per MoE layer per re-choice; each layer keeps as "
    "many spare GPU slots",
}
CPU_DEVICE_ENV_VAR = "KT_SGLANG_CPU_DEVICE"  # set when SGLang serves with --device cpu


class KtSettingsError(ValueError):
    """A `--kt-*` flag is wrong; the message says which and what to change."""


@dataclass(frozen=True)
class KtSettings:
    weight_path: str
    method: str
    cpuinfer: int
    threadpool_count: int
    num_gpu_experts: int | None  # per MoE layer; None: from gpu_experts_ratio, else 0
    gpu_experts_ratio: float | None
    max_deferred_experts_per_token: int
    numa_nodes: list[int] | None
    placement_strategy: str
    placement_stats: str | None
    record_placement_stats: str | None
    expert_lora_path: str | None = None
    deferral_max_batch: int | None = None  # None: the layer's default (DEFERRAL_MAX_TOKENS)
    # Chunks of at least this many tokens stream their cold experts to the GPU; "auto": measured at
    # start-up; None: never (kt_sglang/layer/prefill.py)
    gpu_prefill_threshold: int | str | None = None
    gpu_prefill_buffer_gib: float | None = None  # cap of the streaming buffer; None: two layers
    gpu_experts_memory_gib: float | None = None  # GPU slots of all MoE layers, instead of a count
    heat: dict[str, float | int] | None = None  # the --kt-heat-* flags given (HeatConfig fields)

    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> KtSettings | None:
        raw = os.environ.get(ENV_VAR)
        return cls(**json.loads(raw)) if raw else None

    def heat_config(self) -> HeatConfig:
        from kt_sglang.placement.heat import HeatConfig

        return HeatConfig(**(self.heat or {}))

    def spare_slots(self, hot: int, num_experts: int) -> int:
        """The spare GPU slots a layer of ``hot`` hot experts keeps (placement by heat only)."""
        if self.placement_strategy != "heat":
            return 0
        return min(self.heat_config().max_moves, num_experts - hot)

    def total_hot(self, num_experts: int, num_moe_layers: int, one_expert_bytes: int | None = None) -> int:
        """Hot experts over all MoE layers; with --kt-gpu-experts-memory-gib, from the bytes of one
        expert on the GPU (its slots less the spares of placement by heat, per layer)."""
        if self.gpu_experts_memory_gib is not None:
            from kt_sglang.placement.strategies import slots_for_memory

            if one_expert_bytes is None:
                raise ValueError("--kt-gpu-experts-memory-gib: the bytes of one expert are needed")
            slots = slots_for_memory(
                self.gpu_experts_memory_gib, num_moe_layers, one_expert_bytes, num_experts
            )
            spares = min(self.heat_config().max_moves, slots) if self.placement_strategy == "heat" else 0
            return (slots - spares) * num_moe_layers
        if self.gpu_experts_ratio is not None:
            return round(self.gpu_experts_ratio * num_experts * num_moe_layers)
        return (self.num_gpu_experts or 0) * num_moe_layers


def heat_flag(field: str) -> str:
    return HEAT_FLAG_PREFIX + field.replace("_", "-")


def add_extra_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Our flags, beyond the ones SGLang declares."""
    from kt_sglang.placement import STRATEGIES, HeatConfig

    parser.add_argument(
        "--kt-numa-nodes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="NUMA node of each thread pool, comma separated (e.g. 0,0 for two pools on node 0); "
        "default: pool p on node p",
    )
    parser.add_argument(
        "--kt-gpu-experts-ratio",
        type=float,
        default=None,
        help="hot experts as a fraction of all experts of all MoE layers (instead of --kt-num-gpu-experts)",
    )
    parser.add_argument(
        "--kt-gpu-experts-memory-gib",
        type=float,
        default=None,
        help="GPU memory for the routed experts' slots, in GiB over all MoE layers (instead of "
        "--kt-num-gpu-experts): slots per layer = this / (MoE layers x the bytes of one expert)",
    )
    parser.add_argument(
        "--kt-expert-placement-strategy",
        choices=STRATEGIES,
        default="uniform",
        help="which experts are hot: the same ids in every layer (uniform), whole layers first "
        "(front-loading), seeded random ids (random), the most routed ones (frequency), or those "
        "routed to most lately, re-chosen while serving (heat)",
    )
    defaults = HeatConfig()
    for field in HeatConfig.field_names():
        default = getattr(defaults, field)
        parser.add_argument(
            heat_flag(field), type=type(default), default=None, help=f"{HEAT_HELP[field]} (default {default})"
        )
    parser.add_argument(
        "--kt-placement-stats", default=None, help="routing statistics file read by the frequency strategy"
    )
    parser.add_argument(
        "--kt-expert-lora-path",
        default=None,
        help="a PEFT adapter directory of the routed experts (kt-sglang finetune writes one): merged into "
        "the CPU and GPU experts' weights at load",
    )
    parser.add_argument(
        "--kt-deferral-max-batch",
        type=int,
        default=None,
        help="the largest batch (tokens) whose cold experts are deferred; larger ones defer none "
        "(default 1: where deferral was measured to pay; bench/bench_decode_step.py measures it)",
    )
    parser.add_argument(
        "--kt-gpu-prefill-token-threshold",
        default=None,
        metavar="N|auto",
        help="forward chunks of at least N tokens compute their cold experts on the GPU, the experts "
        "streamed from host memory layer by layer (kt-kernel's flag); auto: the crossover measured at "
        "start-up from the host-to-device bandwidth and the CPU engine's prefill rate; default: off",
    )
    parser.add_argument(
        "--kt-gpu-prefill-buffer-gib",
        type=float,
        default=None,
        help="GPU memory for the streamed experts (default: two MoE layers' cold experts; less: each "
        "layer passes in rounds)",
    )
    parser.add_argument(
        "--kt-record-placement-stats",
        default=None,
        help="write the routing statistics observed while serving to this file (merged with what it holds)",
    )


def extra_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_extra_arguments(parser)
    return parser


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our flags out of argv; the rest is SGLang's."""
    return extra_parser().parse_known_args(argv)


def early_server_args(rest: list[str]) -> argparse.Namespace | None:
    """The few SGLang flags our checks read, parsed from argv as SGLang will (same names, types and
    defaults), so that the `--kt-*` settings are checked before SGLang's own parsing and model
    inspection; None when argv does not parse (SGLang then reports it)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--model-path", "--model", dest="model_path", default=None)
    parser.add_argument("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size", type=int, default=1)
    parser.add_argument("--device", default=None)
    parser.add_argument("--kt-weight-path", default=None)
    parser.add_argument("--kt-method", default="AMXINT4")
    parser.add_argument("--kt-cpuinfer", type=int, default=None)
    parser.add_argument("--kt-threadpool-count", type=int, default=2)
    parser.add_argument("--kt-num-gpu-experts", type=int, default=None)
    parser.add_argument("--kt-max-deferred-experts-per-token", type=int, default=None)
    try:
        args, _ = parser.parse_known_args(rest)
    except (argparse.ArgumentError, SystemExit, ValueError):  # silent: SGLang's parser reports it
        return None
    return args if args.model_path is not None else None


def check_accelerator(device: str | None) -> None:
    """Without --device, SGLang looks for an accelerator and dies with a long traceback if there is none."""
    if device is not None:
        return
    from sglang.srt.utils.common import get_device

    try:
        get_device()
    except RuntimeError as exc:
        raise KtSettingsError(
            "no GPU (or other accelerator) found: add --device cpu to serve on this machine's CPU "
            f"(SGLang: {exc})"
        ) from None


def extra_help() -> str:
    parser = argparse.ArgumentParser(prog="kt-sglang options", add_help=False)
    add_extra_arguments(parser.add_argument_group("kt-sglang (CPU experts) options"))
    return parser.format_help()


def flag_given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


@dataclass(frozen=True)
class ModelFacts:
    num_experts: int
    top_k: int
    moe_layers: list[int]
    intermediate_size: int  # of one routed expert


def model_facts(model_path: str) -> ModelFacts | None:
    """Expert count, top-k and MoE layers from a local model directory (None: not a local dir)."""
    from kt_sglang.weights.checkpoint import open_checkpoint

    if not (Path(model_path) / "config.json").is_file():
        return None
    spec = open_checkpoint(model_path).spec
    return ModelFacts(spec.num_experts, spec.top_k, list(spec.moe_layers), spec.intermediate_size)


def resolve(server_args, extra: argparse.Namespace, argv: list[str]) -> KtSettings | None:
    """All `--kt-*` settings with defaults filled in and checked; None when CPU experts are off."""
    from kt_sglang.engine.methods import FILE_METHODS, parse_method
    from kt_sglang.engine.pools import check_thread_count, machine_nodes, reserved_cores, serving_threads

    weight_path = getattr(server_args, "kt_weight_path", None)
    ours = [f for f, v in vars(extra).items() if v not in (None, "uniform")]
    if weight_path is None:
        if ours:
            flags = ", ".join("--" + f.replace("_", "-") for f in ours)
            raise KtSettingsError(
                f"{flags} given without --kt-weight-path: set --kt-weight-path to enable CPU experts"
            )
        return None
    tp_size = getattr(server_args, "tp_size", 1) or 1
    check_cpu_tensor_parallel(server_args, tp_size)
    if tp_size > 1 and extra.kt_expert_placement_strategy == "heat":
        raise KtSettingsError(
            f"--kt-expert-placement-strategy heat with --tp-size {tp_size}: each rank would commit its "
            "moves on its own schedule; use another placement with tensor parallelism"
        )
    try:
        name = str(server_args.kt_method).upper()
        method = name if name in FILE_METHODS else parse_method(name).value
    except ValueError as exc:
        raise KtSettingsError(f"--kt-method: {exc}") from None
    source = weight_source(weight_path)
    if not flag_given(argv, "--kt-method"):
        try:  # a converted or kt-kernel directory records its method: SGLang's default gives way
            method = source.recorded_method() or method
        except ValueError as exc:
            raise KtSettingsError(f"--kt-weight-path: {exc}") from None
    nodes = len(machine_nodes())
    threads = server_args.kt_cpuinfer if server_args.kt_cpuinfer is not None else serving_threads()
    try:
        check_thread_count(threads, "--kt-cpuinfer")
    except ValueError as exc:
        raise KtSettingsError(str(exc)) from None
    if threads > serving_threads():
        warnings.warn(
            f"--kt-cpuinfer {threads} leaves fewer than {reserved_cores()} core(s) to the serving process's "
            f"own threads (rule: a quarter of the cores, at least one; default here {serving_threads()}): on "
            "a 16-core H100 host the hybrid step ran 14-25x slower with 16 engine threads than with 12",
            stacklevel=2,
        )
    pools = server_args.kt_threadpool_count if flag_given(argv, "--kt-threadpool-count") else None
    if extra.kt_numa_nodes is not None:
        pools = pools or len(extra.kt_numa_nodes)
        if len(extra.kt_numa_nodes) != pools:
            raise KtSettingsError(
                f"--kt-numa-nodes names {len(extra.kt_numa_nodes)} nodes for {pools} pools "
                "(--kt-threadpool-count)"
            )
    if extra.kt_numa_nodes is not None:
        known = sorted(n["os_index"] for n in machine_nodes())
        if unknown := [n for n in extra.kt_numa_nodes if n not in known]:
            raise KtSettingsError(
                f"--kt-numa-nodes names node(s) {unknown} that this machine lacks; its nodes: {known}"
            )
    pools = pools or min(nodes, threads)
    if extra.kt_numa_nodes is None and not 1 <= pools <= nodes:
        raise KtSettingsError(
            f"--kt-threadpool-count {pools}: this machine has {nodes} NUMA node(s); use 1..{nodes} "
            "(or --kt-numa-nodes 0,0 for several pools on one node)"
        )
    if pools > threads:
        raise KtSettingsError(f"--kt-threadpool-count {pools} is more than --kt-cpuinfer {threads} threads")
    n_gpu = server_args.kt_num_gpu_experts
    ratio = extra.kt_gpu_experts_ratio
    if n_gpu is not None and ratio is not None:
        raise KtSettingsError("give --kt-num-gpu-experts or --kt-gpu-experts-ratio, not both")
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise KtSettingsError(f"--kt-gpu-experts-ratio {ratio}: use a fraction in [0, 1]")
    if n_gpu is not None and n_gpu < 0:
        raise KtSettingsError(f"--kt-num-gpu-experts {n_gpu}: use 0 or more")
    deferred = server_args.kt_max_deferred_experts_per_token or 0
    if deferred < 0:
        raise KtSettingsError(f"--kt-max-deferred-experts-per-token {deferred}: use 0 or more")
    if extra.kt_deferral_max_batch is not None and extra.kt_deferral_max_batch < 0:
        raise KtSettingsError(f"--kt-deferral-max-batch {extra.kt_deferral_max_batch}: use 0 or more")
    prefill_threshold = parse_prefill_threshold(extra.kt_gpu_prefill_token_threshold)
    if extra.kt_gpu_prefill_buffer_gib is not None:
        if prefill_threshold is None:
            raise KtSettingsError("--kt-gpu-prefill-buffer-gib needs --kt-gpu-prefill-token-threshold")
        if not extra.kt_gpu_prefill_buffer_gib > 0:
            raise KtSettingsError(
                f"--kt-gpu-prefill-buffer-gib {extra.kt_gpu_prefill_buffer_gib}: use more than 0"
            )
    if extra.kt_expert_placement_strategy == "frequency" and not extra.kt_placement_stats:
        raise KtSettingsError("--kt-expert-placement-strategy frequency needs --kt-placement-stats FILE")
    memory = extra.kt_gpu_experts_memory_gib
    if memory is not None and (n_gpu is not None or ratio is not None):
        given = "--kt-num-gpu-experts" if n_gpu is not None else "--kt-gpu-experts-ratio"
        raise KtSettingsError(f"give --kt-gpu-experts-memory-gib or {given}, not both")
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        raise KtSettingsError(f"--kt-gpu-experts-memory-gib {memory}: use a number of GiB > 0")
    heat = check_heat_flags(extra, n_gpu, ratio, memory)
    if heat is not None and extra.kt_expert_lora_path:
        raise KtSettingsError(
            "--kt-expert-lora-path with --kt-expert-placement-strategy heat: the adapter is merged into "
            "the hot experts' GPU weights only, not into the host copies moves read; use another placement"
        )
    settings = KtSettings(
        weight_path=str(weight_path),
        method=method,
        cpuinfer=threads,
        threadpool_count=pools,
        num_gpu_experts=n_gpu,
        gpu_experts_ratio=ratio,
        max_deferred_experts_per_token=deferred,
        numa_nodes=extra.kt_numa_nodes,
        placement_strategy=extra.kt_expert_placement_strategy,
        placement_stats=extra.kt_placement_stats,
        record_placement_stats=extra.kt_record_placement_stats,
        expert_lora_path=extra.kt_expert_lora_path,
        deferral_max_batch=extra.kt_deferral_max_batch,
        gpu_prefill_threshold=prefill_threshold,
        gpu_prefill_buffer_gib=extra.kt_gpu_prefill_buffer_gib,
        gpu_experts_memory_gib=memory,
        heat=heat,
    )
    check_against_model(settings, source, server_args.model_path)
    if settings.expert_lora_path:
        check_expert_adapter(settings, source)
    return settings


def weight_source(weight_path: str) -> WeightSource:
    """The source at --kt-weight-path (what it is, from its markers: nothing is read yet)."""
    from kt_sglang.engine.weight_source import open_source

    try:
        return open_source(weight_path)
    except ValueError as exc:
        raise KtSettingsError(f"--kt-weight-path: {exc}") from None


def check_cpu_tensor_parallel(server_args, tp_size: int) -> None:
    """On the CPU device SGLang pads the experts' intermediate size to a multiple of 32 x the ranks
    for its kernels (adjust_config_with_unaligned_cpu_tp); the CPU engine computes the checkpoint's
    own size, so the two must agree. GPUs shard the size as it is."""
    if tp_size <= 1 or getattr(server_args, "device", None) != "cpu":
        return
    facts = model_facts(server_args.model_path)
    if facts is not None and facts.intermediate_size % (32 * tp_size):
        fits = [n for n in (2, 4, 8) if facts.intermediate_size % (32 * n) == 0]
        raise KtSettingsError(
            f"--tp-size {tp_size} with --device cpu: SGLang pads the experts' intermediate size "
            f"{facts.intermediate_size} to a multiple of {32 * tp_size} on the CPU device, which the CPU "
            f"experts cannot follow; use --tp-size {' or '.join(map(str, fits)) if fits else 1}"
        )


def parse_prefill_threshold(value: str | None) -> int | str | None:
    """``--kt-gpu-prefill-token-threshold``: a token count (0: off), or ``auto``."""
    if value is None or value == "0":
        return None
    if value == "auto":
        return value
    try:
        tokens = int(value)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise KtSettingsError(
            f"--kt-gpu-prefill-token-threshold {value!r}: give a number of tokens (0: off) or auto"
        )
    return tokens


def check_heat_flags(
    extra: argparse.Namespace, n_gpu: int | None, ratio: float | None, memory: float | None
) -> dict[str, float | int] | None:
    """The --kt-heat-* flags given, checked as `HeatConfig` checks its fields; None unless the
    placement is heat."""
    from kt_sglang.placement import HeatConfig, HeatConfigError

    given = {
        field: getattr(extra, "kt_heat_" + field)
        for field in HeatConfig.field_names()
        if getattr(extra, "kt_heat_" + field) is not None
    }
    if extra.kt_expert_placement_strategy != "heat":
        if given:
            flags = ", ".join(heat_flag(f) for f in given)
            raise KtSettingsError(f"{flags}: only with --kt-expert-placement-strategy heat")
        return None
    try:
        HeatConfig(**given)
    except HeatConfigError as exc:
        raise KtSettingsError(f"{heat_flag(exc.field)} {exc.detail}") from None
    if (n_gpu or 0) == 0 and not ratio and memory is None:
        raise KtSettingsError(
            "--kt-expert-placement-strategy heat moves experts in and out of GPU slots: give them some "
            "with --kt-num-gpu-experts N (N >= 1), --kt-gpu-experts-ratio or --kt-gpu-experts-memory-gib"
        )
    return given


def check_expert_adapter(settings: KtSettings, source: WeightSource) -> None:
    """The adapter opens, and the CPU experts can take it: it is merged into dense weights before the
    engine quantizes them, so --kt-weight-path must be a checkpoint of bf16 / fp16 / fp32 (or FP8)
    experts and --kt-method one the engine quantizes to."""
    from kt_sglang.engine.methods import METHODS
    from kt_sglang.finetune.adapter import AdapterError, ExpertAdapter

    try:
        ExpertAdapter(settings.expert_lora_path)
    except AdapterError as exc:
        raise KtSettingsError(f"--kt-expert-lora-path: {exc}") from None
    quantizing = [m.value for m, info in METHODS.items() if info.quantizes_dense]
    if settings.method not in quantizing:
        raise KtSettingsError(
            f"--kt-expert-lora-path with --kt-method {settings.method}: the adapter is merged into the "
            f"weights before they are quantized; use one of {', '.join(quantizing)}"
        )
    try:
        source.check_adapter()
    except ValueError as exc:
        raise KtSettingsError(f"--kt-expert-lora-path with --kt-weight-path: {exc}") from None


def check_memory_budget(settings: KtSettings, model_path: str, facts: ModelFacts) -> None:
    """--kt-gpu-experts-memory-gib holds at least one hot expert per MoE layer (in bf16: quantized
    GPU experts take fewer bytes, and more of them fit)."""
    from kt_sglang.placement.strategies import GIB, expert_bytes
    from kt_sglang.weights.checkpoint import open_checkpoint

    spec = open_checkpoint(model_path).spec
    one = expert_bytes(spec.hidden_size, spec.intermediate_size, 2)
    layers = len(facts.moe_layers)
    if settings.total_hot(facts.num_experts, layers, one) == 0:
        spares = settings.heat_config().max_moves if settings.placement_strategy == "heat" else 0
        raise KtSettingsError(
            f"--kt-gpu-experts-memory-gib {settings.gpu_experts_memory_gib} holds no hot expert: one "
            f"expert takes {one / GIB * 1024:.2f} MiB on the GPU, {layers} MoE layers need "
            f"{(1 + spares) * one * layers / GIB:.3f} GiB for one each"
            + (f" (and {spares} spare slot(s) each for placement by heat)" if spares else "")
        )


def check_against_model(settings: KtSettings, source: WeightSource, model_path: str) -> None:
    """The method reads the source, and (when the model is a local directory) the counts and files
    fit the model's config."""
    from kt_sglang.placement import PlacementStats
    from kt_sglang.weights.checkpoint import open_checkpoint

    try:
        source.check_method(settings.method, "--kt-method")
    except ValueError as exc:
        raise KtSettingsError(f"--kt-weight-path: {exc}") from None
    facts = model_facts(model_path)
    if facts is None:
        return
    E, k = facts.num_experts, facts.top_k
    if settings.gpu_experts_memory_gib is not None:
        check_memory_budget(settings, model_path, facts)
    if settings.num_gpu_experts is not None and settings.num_gpu_experts > E:
        raise KtSettingsError(
            f"--kt-num-gpu-experts {settings.num_gpu_experts} is more than the model's {E} experts per layer"
        )
    if settings.max_deferred_experts_per_token >= k:
        raise KtSettingsError(
            f"--kt-max-deferred-experts-per-token {settings.max_deferred_experts_per_token}: the model "
            f"routes each token to {k} experts; use 0..{k - 1}"
        )
    try:
        model = open_checkpoint(model_path).shape()
    except ValueError as exc:  # e.g. an index that does not describe the model's files
        raise KtSettingsError(f"--model-path: {exc}") from None
    try:
        source.verify(settings.method, model)
        theirs = source.shape()
    except ValueError as exc:  # CheckpointError, unknown family, bad manifest
        raise KtSettingsError(f"--kt-weight-path: {exc}") from None
    if theirs.sizes() != model.sizes():
        raise KtSettingsError(
            f"--kt-weight-path {source.path} is for another model: {theirs.where} has (experts, hidden, "
            f"intermediate) = {theirs.sizes()}; {model_path} has {model.sizes()}"
        )
    if settings.placement_stats:
        try:
            PlacementStats.read(settings.placement_stats).counts(0, E)
        except ValueError as exc:
            raise KtSettingsError(f"--kt-placement-stats: {exc}") from None
