"""`kt-sglang demo`: the README's main job, end to end on a tiny model made on this machine.

Generates a tiny Qwen3-MoE with a locally trained tokenizer, converts its experts to the CPU
format, serves it with `python -m sglang.launch_server ... --kt-*`, sends one chat request to the
OpenAI-compatible endpoint, prints the reply, tokens/s and how many expert computations ran on
each side, and stops the server (also on Ctrl-C).
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

DEFAULT_WORKDIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kt-sglang" / "demo"


def _prepare_model(workdir: Path) -> Path:
    from kt_sglang.tiny_model import write_tiny_moe

    model = workdir / "tiny-qwen3-moe"
    done = model / ".complete"
    if not done.exists():
        print(f"==> generating a tiny Qwen3-MoE model and its tokenizer in {model}")
        write_tiny_moe(model)
        done.touch()
    return model


def _convert(model: Path, workdir: Path, method: str, threads: int) -> Path:
    from kt_sglang.engine.methods import parse_method
    from kt_sglang.weights.convert_cpu import main as convert_cpu

    if not parse_method(method).is_quantized():  # bf16 weights serve from the checkpoint itself
        return model
    out = workdir / f"cpu-weights-{method.lower()}"
    print(f"==> converting the experts to {method} in {out}")
    args = ["--input-path", str(model), "--input-type", "bf16", "--output", str(out)]
    args += ["--quant-method", method, "--cpuinfer-threads", str(threads)]
    if convert_cpu(args) != 0:
        raise RuntimeError("converting the tiny model failed (see above)")
    return out


def run_demo(
    workdir: Path = DEFAULT_WORKDIR,
    method: str = "AMXINT4",
    gpu_experts: int = 2,
    prompt: str = "Tell me a story about a robot who learns to paint.",
    max_tokens: int = 32,
    threads: int | None = None,
) -> int:
    import torch

    from kt_sglang.cli.server import CPU_DEVICE_ARGS, ServerError, SGLangServer, free_port, server_command
    from kt_sglang.engine.pools import physical_cores
    from kt_sglang.placement import PlacementStats, plan_hot_experts

    workdir.mkdir(parents=True, exist_ok=True)
    threads = threads or physical_cores()
    model = _prepare_model(workdir)
    weights = _convert(model, workdir, method, threads)
    stats_file = workdir / "routing-stats.json"
    stats_file.unlink(missing_ok=True)
    device_args = [] if torch.cuda.is_available() else CPU_DEVICE_ARGS
    kt_args = [
        "--kt-weight-path", str(weights), "--kt-method", method, "--kt-cpuinfer", str(threads),
        "--kt-num-gpu-experts", str(gpu_experts), "--kt-max-deferred-experts-per-token", "0",
        "--kt-record-placement-stats", str(stats_file),
    ]  # fmt: skip
    port = free_port()
    command = server_command(model, device_args + kt_args, port)
    print("==> serving:", shlex.join(command))
    os.environ["KT_SGLANG_STATS_INTERVAL_S"] = "0"  # the server writes the counts as it goes
    log = workdir / "server.log"
    try:
        with SGLangServer(command, log, port) as server:
            print(f"==> server ready on {server.url} (log: {log})")
            print(f"user: {prompt}")
            start = time.perf_counter()
            reply = server.post(
                "/v1/chat/completions",
                {
                    "model": str(model),
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                },
            )
            seconds = time.perf_counter() - start
            marker = "kt-sglang: CPU experts on"
            plugin_line = next((ln for ln in server.log_tail(2000).splitlines() if marker in ln), None)
    except ServerError as exc:
        print(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: the server was stopped")
        return 130
    text = reply["choices"][0]["message"]["content"]
    tokens = reply["usage"]["completion_tokens"]
    print(f"assistant: {text!r}")
    print(f"{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s (tiny random model)")
    if plugin_line is None:
        print("error: the server log does not show the kt-sglang plugin")
        return 1
    print("plugin:", plugin_line.split("kt-sglang: ", 1)[1])
    stats = PlacementStats.read(stats_file)
    layers = sorted(stats.layers)
    plan = plan_hot_experts("uniform", layers, stats.num_experts, gpu_experts * len(layers))
    hot = sum(stats.layers[la][e] for la in layers for e in plan[la])
    cold = sum(sum(stats.layers[la]) for la in layers) - hot
    side = "GPU" if torch.cuda.is_available() else "GPU side (CPU device)"
    print(f"expert computations (token x expert): {cold} on the CPU engine, {hot} on the {side}")
    return 0 if cold > 0 and tokens > 0 else 1
