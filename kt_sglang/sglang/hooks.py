"""The hook functions `register()` installs into SGLang."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from kt_sglang.sglang.settings import (
    CPU_DEVICE_ENV_VAR,
    KtSettings,
    KtSettingsError,
    check_accelerator,
    early_server_args,
    extra_help,
    resolve,
    split_argv,
)

logger = logging.getLogger("kt_sglang")


_checked_early = False  # register() checked this process's flags already
HEAT_LOG_STEPS = 4096  # placement by heat logs its moves at the first and every this many steps


def check_flags_early(argv: list[str]) -> None:
    """The `--kt-*` settings checked from argv alone (KtSettingsError), before SGLang parses it."""
    global _checked_early
    _checked_early = True
    extra, rest = split_argv(list(argv))
    if "-h" in rest or "--help" in rest:
        return
    early = early_server_args(rest)
    if early is not None and resolve(early, extra, list(argv)) is not None:
        check_accelerator(early.device)


def launcher_argv(argv: list[str]) -> list[str] | None:
    """SGLang's arguments when this process is `python -m sglang.launch_server` or `sglang serve`
    (as `sglang serve` reads them: a first positional is the model); None for any other process."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:  # workers inherit the launcher's argv
        return None
    name, rest = Path(argv[0]).name if argv else "", list(argv[1:])
    if name == "launch_server.py":
        return rest
    if name == "sglang" and rest[:1] == ["serve"]:
        rest = rest[1:]
        return ["--model-path", *rest] if rest and not rest[0].startswith("-") else rest
    return None


def exit_on_flag_error(check, *args):
    try:
        return check(*args)
    except KtSettingsError as exc:
        print(f"kt-sglang: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def prepare_server_args(original, argv: list[str]):
    """Our flags out of argv, SGLang parses the rest; then every `--kt-*` setting is resolved and
    checked. A wrong flag stops the launcher with one message (exit code 2), before any worker starts."""
    extra, rest = split_argv(list(argv))
    if "-h" in rest or "--help" in rest:
        print(extra_help())
        return original(rest)
    try:
        if not _checked_early:  # another launcher than register() knows
            check_flags_early(argv)
        server_args = original(rest)
        settings = resolve(server_args, extra, list(argv))
    except KtSettingsError as exc:
        print(f"kt-sglang: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if settings is not None:
        settings.to_env()
        server_args.kt_method = settings.method  # what a converted --kt-weight-path records, if not given
    if server_args.device == "cpu":
        os.environ[CPU_DEVICE_ENV_VAR] = "1"
        enable_cpu_rotary()
        if settings is not None and (server_args.tp_size or 1) > 1:
            os.environ.update(cpu_tensor_parallel_environment(server_args.tp_size))
    return server_args


def cpu_tensor_parallel_environment(tp_size: int) -> dict[str, str]:
    """What SGLang 0.5.23's CPU backend needs for --tp-size > 1 here (the worker processes inherit
    it; a variable already set is kept):
    - SGLANG_NCCL_SO_PATH at a library that does not exist: its CPU platform builds a NCCL
      communicator for every group, which fails to initialize with a CUDA build of torch; with no
      library it disables itself and the CPU all-reduce serves;
    - SGLANG_CPU_OMP_THREADS_BIND: without it SGLang wants a NUMA node per rank; the cores are split
      evenly over the ranks instead (a rank's torch threads; the engine's workers, on rank 0, keep
      their own pinning)."""
    from kt_sglang.engine.pools import machine_nodes

    env = {"SGLANG_NCCL_SO_PATH": "/nonexistent/kt-sglang-cpu-tensor-parallel/libnccl.so.2"}
    if tp_size > len(machine_nodes()):
        cores = sorted(os.sched_getaffinity(0))
        shares = [
            cores[r * len(cores) // tp_size : (r + 1) * len(cores) // tp_size] or cores[:1]
            for r in range(tp_size)
        ]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, share)) for share in shares)
    return {k: v for k, v in env.items() if k not in os.environ}


def validate_request(original, manager, obj, input_ids, *args, **kwargs):
    """Refuses, as a 400, generate requests that SGLang 0.5.23's scheduler dies on."""
    vocab = manager.model_config.vocab_size
    if hasattr(obj, "top_logprobs_num"):  # a generate request (not an embedding one)
        if input_ids is not None and len(input_ids) == 0:
            raise ValueError("the prompt has no tokens: send at least one (text or input_ids)")
        if (
            input_ids is not None
            and (bad := next((t for t in input_ids if not 0 <= t < vocab), None)) is not None
        ):
            raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab})")
        top = obj.top_logprobs_num
        if obj.return_logprob and isinstance(top, int) and top > vocab:
            raise ValueError(f"top_logprobs_num {top} is more than the vocabulary's {vocab} tokens")
    return original(manager, obj, input_ids, *args, **kwargs)


def weight_loader_impl(original, layer, *args, **kwargs):
    """Checkpoint expert id -> GPU slot for our layers; cold experts are not loaded on the GPU."""
    from kt_sglang.sglang.method import KTEPWrapperMethod

    method = layer.quant_method
    if not isinstance(method, KTEPWrapperMethod):
        return original(layer, *args, **kwargs)
    names = ("param", "loaded_weight", "weight_name", "shard_id", "expert_id")
    bound = dict(zip(names, args, strict=False)) | kwargs
    host = method.host_copy_of(bound["param"])
    if host is not None:  # placement by heat: every expert's GPU weights also on the host
        original(layer, **(bound | {"param": host}))
    slot = method.gpu_slot(int(bound["expert_id"]))
    if slot < 0:
        return None
    bound["expert_id"] = slot
    return original(layer, **bound)


def weight_loader(original, layer, *args, **kwargs):
    """All experts in one tensor (expert_id None: SGLang's MXFP4 loader for gpt-oss) -> the hot
    experts' rows in slot order for our layers; nothing to load when every expert is cold."""
    from kt_sglang.sglang.method import KTEPWrapperMethod

    method = layer.quant_method
    names = ("param", "loaded_weight", "weight_name", "shard_id", "expert_id")
    bound = dict(zip(names, args, strict=False)) | kwargs
    if not isinstance(method, KTEPWrapperMethod) or bound.get("expert_id") is not None:
        return original(layer, *args, **kwargs)
    if method.num_hot == 0:
        return None
    bound["loaded_weight"] = method.hot_rows(bound["loaded_weight"])
    return original(layer, **bound)


def after_load_model(result, model_runner, *args, **kwargs):
    """Attaches and links the MoE layers of the model just loaded; fails loudly if SGLang built
    upstream's wrapper (or none) while CPU experts were asked for."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.runtime_context import get_parallel

    from kt_sglang.engine.native import _native
    from kt_sglang.layer.hybrid import DeferralChain, HybridMoELayer
    from kt_sglang.sglang.method import KTEPWrapperMethod, heat_placement

    settings = KtSettings.from_env()
    if settings is None:
        return result
    moe = [m for m in model_runner.model.modules() if isinstance(m, FusedMoE)]
    ours = sorted((m for m in moe if isinstance(m.quant_method, KTEPWrapperMethod)), key=lambda m: m.layer_id)
    if not ours or len(ours) != len(moe):
        kinds = sorted({type(m.quant_method).__module__ + "." + type(m.quant_method).__name__ for m in moe})
        raise RuntimeError(
            f"kt-sglang: --kt-weight-path is set but SGLang built {kinds or 'no FusedMoE layer'} for the "
            "model's MoE layers, not kt-sglang's KTEPWrapperMethod: is the plugin disabled (SGLANG_PLUGINS)?"
        )
    chain = DeferralChain()  # one per model: a draft model gets its own
    for m in ours:
        m.quant_method.attach(m, chain)
    hybrids = [m.quant_method.hybrid for m in ours if m.quant_method.hybrid is not None]
    HybridMoELayer.link(hybrids)
    # placement by heat: re-chosen between forward steps (after_forward)
    model_runner.kt_heat_placement = heat_placement([m.quant_method for m in ours], settings)
    if settings.gpu_prefill_threshold is not None and hybrids and hybrids[0].experts is not None:
        enable_gpu_prefill(hybrids, settings)  # where the cold experts are: rank 0
    hot = [m.quant_method.num_hot for m in ours]
    mapped = sum(m.quant_method.wrapper is not None and m.quant_method.wrapper.mapped for m in ours)
    rank, ranks = ours[0].quant_method.tp_rank, get_parallel().tp_size
    if ranks > 1:
        logger.info(
            "kt-sglang: tensor-parallel rank %d of %d: %s",
            rank,
            ranks,
            f"computes every cold expert on {settings.cpuinfer} engine threads (the other ranks: none)"
            if rank == 0
            else "its share of the hot experts; the cold experts are rank 0's (0 engine threads here)",
        )
    if rank != 0:
        return result
    logger.info(
        "kt-sglang: CPU experts on, method %s, %d threads in %d pool(s), ISA %s, "
        "hot experts per MoE layer %s (%s placement), deferred per token %d, %d MoE layers "
        "(%d computed from mapped packed files)",
        settings.method,
        settings.cpuinfer,
        settings.threadpool_count,
        _native.selected_isa(),
        hot if len(set(hot)) > 1 else hot[0],
        settings.placement_strategy,
        settings.max_deferred_experts_per_token,
        len(ours),
        mapped,
    )
    return result


def enable_gpu_prefill(layers, settings: KtSettings) -> None:
    """Long chunks' cold experts streamed to the GPU (on the CPU device: the same path in torch)."""
    import torch

    from kt_sglang.layer import GpuPrefill, HybridMoELayer
    from kt_sglang.layer.prefill import auto_crossover

    on_cpu = os.environ.get(CPU_DEVICE_ENV_VAR) == "1" or not torch.cuda.is_available()
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    threshold = settings.gpu_prefill_threshold
    if threshold == "auto":
        if on_cpu:
            logger.info(
                "kt-sglang: --kt-gpu-prefill-token-threshold auto: no GPU, prompts stay on the engine"
            )
            return
        found = auto_crossover(layers[0].experts, layers[0].hot_experts, device)
        logger.info("kt-sglang: %s", found.line())
        threshold = found.threshold
    cap = settings.gpu_prefill_buffer_gib
    HybridMoELayer.enable_gpu_prefill(
        layers, GpuPrefill(threshold, device, None if cap is None else int(cap * 2**30))
    )


def after_forward(result, model_runner, *args, **kwargs):
    """Placement by heat: a step of the model's placement after each forward."""
    placement = getattr(model_runner, "kt_heat_placement", None)
    if placement is not None:
        moved = placement.step()
        if (moved and placement.moves == moved) or placement.steps % HEAT_LOG_STEPS == 0:
            logger.info(
                "kt-sglang: placement by heat: %d expert moves in %d forward steps",
                placement.moves,
                placement.steps,
            )
    return result


def connect_cuda_graph_batch_sizes() -> None:
    """SGLang's decode graph runner hands its capture sizes to `KTMoEWrapper` when it can import
    one; give it ours, so pinned buffers exist for every captured batch size."""
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as runner

    from kt_sglang.engine.wrapper import KTMoEWrapper

    runner.KTMoEWrapper = KTMoEWrapper
    runner.KTRANSFORMERS_AVAILABLE = True


def enable_cpu_rotary() -> None:
    """With --device cpu and no CPU platform package, SGLang's rotary embedding reaches for vLLM's
    custom op; its CPU flag selects the torch implementation (patches/0001-rotary-cpu-flag.diff)."""
    from sglang.srt.layers.rotary_embedding import base

    base._is_cpu = True
