"""`kt-sglang demo`: the README's main job, end to end on the project's own trained model.

Converts the experts of the small Shakespeare MoE shipped with the package (kt_sglang/shakespeare)
to the CPU format, serves it with `python -m sglang.launch_server ... --kt-*`, sends a speaker and a
line to the OpenAI-compatible completions endpoint, prints the continuation, tokens/s and how many
expert computations ran on each side, and stops the server (also on Ctrl-C or SIGTERM, at any point).
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path

DEFAULT_WORKDIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kt-sglang" / "demo"


def _convert(model: Path, workdir: Path, method: str, threads: int) -> Path:
    from kt_sglang.cli.server import ServerError
    from kt_sglang.engine.methods import parse_method
    from kt_sglang.weights.convert_cpu import main as convert_cpu

    if not parse_method(method).is_quantized():  # bf16 weights serve from the checkpoint itself
        return model
    out = workdir / f"{model.name}-{method.lower()}"
    print(f"==> converting the experts to {method} in {out}")
    args = ["--input-path", str(model), "--input-type", "bf16", "--output", str(out)]
    args += ["--quant-method", method, "--cpuinfer-threads", str(threads)]
    status = convert_cpu(args)
    if status == 130:
        raise KeyboardInterrupt
    if status != 0:
        raise ServerError("converting the experts failed (see above)")
    return out


DEFAULT_PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n"


def _stop_on_sigterm() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so the server is stopped on every exit path."""

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)


def run_demo(
    workdir: Path = DEFAULT_WORKDIR,
    method: str = "AMXINT4",
    gpu_experts: int = 4,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 64,
    threads: int | None = None,
) -> int:
    try:
        _stop_on_sigterm()
        return _run_demo(workdir, method, gpu_experts, prompt, max_tokens, threads)
    except KeyboardInterrupt:
        print("\ninterrupted: nothing is left running")
        return 130


def _run_demo(workdir: Path, method: str, gpu_experts: int, prompt: str, max_tokens: int, threads) -> int:
    import torch

    from kt_sglang.cli.server import CPU_DEVICE_ARGS, ServerError, SGLangServer, free_port, server_command
    from kt_sglang.engine.pools import serving_threads
    from kt_sglang.placement import PlacementStats, plan_hot_experts
    from kt_sglang.shakespeare.model import MODEL_DIR

    workdir.mkdir(parents=True, exist_ok=True)
    threads = threads or serving_threads()
    model = MODEL_DIR
    print(f"==> model: the Shakespeare MoE trained for this project ({model})")
    try:
        weights = _convert(model, workdir, method, threads)
    except ServerError as exc:
        print(f"error: {exc}")
        return 1
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
            print("prompt:\n" + prompt)
            start = time.perf_counter()
            reply = server.post(
                "/v1/completions",
                {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            )
            seconds = time.perf_counter() - start
            marker = "kt-sglang: CPU experts on"
            plugin_line = next((ln for ln in server.log_tail(2000).splitlines() if marker in ln), None)
    except ServerError as exc:
        print(f"error: {exc}")
        return 1
    text = reply["choices"][0]["text"]
    tokens = reply["usage"]["completion_tokens"]
    print("continuation:\n" + prompt + text)
    print(f"{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s")
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
