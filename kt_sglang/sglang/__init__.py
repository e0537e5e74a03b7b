"""The SGLang plugin: `register()` is the `sglang.srt.plugins` entry point, run in every SGLang process.

It installs hooks through SGLang's `HookRegistry` (no fork, no edits to SGLang's files):

- REPLACE `kt_ep_wrapper.KTEPWrapperMethod` by ours, so every FusedMoE model gets the hybrid layer;
- AROUND `server_args.prepare_server_args`: take our flags out of argv, resolve and validate all
  `--kt-*` settings, hand them to the workers;
- AROUND `FusedMoE._weight_loader_impl`: hot experts load into their GPU slots, cold ones not
  at all; AROUND `FusedMoE.weight_loader`: the same for a tensor of all experts (gpt-oss's MXFP4);
- AFTER `ModelRunner.load_model`: attach and link the model's MoE layers (deferral chain), check
  that our wrapper is the one SGLang built, log one line;
- AFTER `ModelRunner.forward`: with placement by heat, re-choose the hot experts between steps;
- the decode CUDA-graph runner's batch sizes reach our pinned buffers;
- AROUND `TokenizerManager._validate_one_request`: requests that would kill the scheduler (no
  tokens, token ids outside the vocabulary, more top log-probabilities than the vocabulary) get a
  400 naming the problem;
- with `--device cpu`, the rotary embedding's CPU platform flag (SGLang's only CPU-serving gap).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("kt_sglang")

ACTIVE_MARKER = "kt-sglang plugin active"


def register() -> None:
    from kt_sglang.sglang import hooks

    # In the launcher, check the --kt-* flags first: the imports below take seconds, and a typo
    # should not wait for them (nor for SGLang's own parsing).
    argv = hooks.launcher_argv(sys.argv)
    if argv is not None and any(a.startswith("--kt-") for a in argv):
        hooks.exit_on_flag_error(hooks.check_flags_early, argv)

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kt_sglang.sglang.method import KTEPWrapperMethod
    from kt_sglang.sglang.settings import CPU_DEVICE_ENV_VAR

    HookRegistry.register(
        "sglang.srt.layers.moe.kt_ep_wrapper.KTEPWrapperMethod", KTEPWrapperMethod, HookType.REPLACE
    )
    HookRegistry.register(
        "sglang.srt.server_args.prepare_server_args", hooks.prepare_server_args, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE._weight_loader_impl",
        hooks.weight_loader_impl,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.weight_loader",
        hooks.weight_loader,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        hooks.after_load_model,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward", hooks.after_forward, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        hooks.validate_request,
        HookType.AROUND,
    )
    hooks.connect_cuda_graph_batch_sizes()
    if os.environ.get(CPU_DEVICE_ENV_VAR) == "1":  # set by the launcher's prepare_server_args hook
        hooks.enable_cpu_rotary()
    if "--kt-sglang-plugin-probe" in sys.argv:  # lets tests see that register() ran in this process
        print(ACTIVE_MARKER, flush=True)
