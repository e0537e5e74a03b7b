"""`kt-sglang serve MODEL [sglang args]`: SGLang with `--kt-*` flags chosen for this machine.

Threads = physical cores less one per NUMA node of 4+ cores (left to SGLang's scheduler), pools =
NUMA nodes, CPU weights = the checkpoint itself (quantized at load) unless `--kt-weight-path` is
given, hot experts per layer from free GPU memory (none without a GPU; then SGLang runs with
`--device cpu`). Flags given by the user win. Prints the command and replaces this process with it.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

GPU_MEMORY_SHARE_FOR_EXPERTS = 0.4  # of free memory; the rest: dense weights, KV cache, activations


def hot_experts_for_gpu(model: str, free_bytes: int) -> int:
    """Hot experts per MoE layer that fit in a share of free GPU memory (bf16 weights)."""
    from kt_sglang.weights.checkpoint import open_checkpoint

    spec = open_checkpoint(model).spec
    per_expert = 3 * spec.hidden_size * spec.intermediate_size * 2
    per_layer_slot = per_expert * len(spec.moe_layers)
    return max(0, min(spec.num_experts, int(free_bytes * GPU_MEMORY_SHARE_FOR_EXPERTS) // per_layer_slot))


def build_serve_command(model: str, user_args: list[str], method: str | None = None) -> list[str]:
    import torch

    from kt_sglang.cli.server import CPU_DEVICE_FLAGS
    from kt_sglang.engine.pools import machine_nodes, serving_threads
    from kt_sglang.sglang.settings import flag_given

    chosen: list[str] = []

    def default(flag: str, value) -> None:
        if not flag_given(user_args, flag):
            chosen.extend([flag] if value is None else [flag, str(value)])

    default("--kt-weight-path", model)
    if method is not None or _recorded_method(user_args) is None:  # else the plugin takes the recorded one
        default("--kt-method", method or "AMXINT4")
    default("--kt-cpuinfer", serving_threads())
    default("--kt-threadpool-count", len(machine_nodes()))
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        if not any(
            flag_given(user_args, f) for f in ("--kt-gpu-experts-ratio", "--kt-gpu-experts-memory-gib")
        ):
            default("--kt-num-gpu-experts", hot_experts_for_gpu(model, free))
    else:
        default("--kt-num-gpu-experts", 0)
        for flag, value in CPU_DEVICE_FLAGS.items():
            default(flag, value)
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, *chosen, *user_args]


def _recorded_method(user_args: list[str]) -> str | None:
    """The method the user's --kt-weight-path records (a converted directory's), if any."""
    from kt_sglang.engine.weight_source import open_source

    for i, arg in enumerate(user_args):
        if arg == "--kt-weight-path" and i + 1 < len(user_args):
            path = user_args[i + 1]
        elif arg.startswith("--kt-weight-path="):
            path = arg.split("=", 1)[1]
        else:
            continue
        try:
            return open_source(path).recorded_method()
        except ValueError:  # the launcher's check names what is wrong with it
            return None
    return None


def run_serve(model: str, user_args: list[str], method: str | None, dry_run: bool = False) -> int:
    if not Path(model, "config.json").is_file():
        print(f"error: {model} is not a local Hugging Face model directory (no config.json)", file=sys.stderr)
        return 2
    command = build_serve_command(model, user_args, method)
    from kt_sglang.sglang.hooks import check_flags_early, exit_on_flag_error

    exit_on_flag_error(check_flags_early, command[3:])  # in seconds, before SGLang's imports
    print(("" if dry_run else "==> ") + shlex.join(command), flush=True)
    if not dry_run:
        os.execv(command[0], command)
    return 0  # not reached
