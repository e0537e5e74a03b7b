"""A CPU-only model of the GPU path's thread contention: one MoE layer's forward, called many times,
alone and beside busy processes that stand in for the CUDA callback thread and the Python thread
spinning in `synchronize` (which on a GPU host compete with the engine for its cores).

    python bench/bench_contention.py [--threads N] [--busy 1] [--calls 400] [--tokens 1]
                                     [--method AMXINT4] [--out FILE]

Qwen3-30B-A3B layer shapes (H 2048, I 768, 128 experts, top-8). Reports per-call latency (median,
p90, worst) alone and beside `--busy` spinning processes, and their ratios. The engine's threads
default to every core: the case the serving rule avoids by default, and which the engine must
still survive without multi-millisecond stalls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.pools import physical_cores

H, I, E, K = 2048, 768, 128, 8


def latencies(layer: KTMoEWrapper, hidden, ids, weights, calls: int) -> list[float]:
    for _ in range(10):
        layer.forward(hidden, ids, weights)
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        layer.forward(hidden, ids, weights)
        out.append(time.perf_counter() - t)
    return out


def summary(times: list[float]) -> dict:
    s = sorted(times)
    return {
        "median_ms": statistics.median(s) * 1e3,
        "p90_ms": s[int(0.9 * (len(s) - 1))] * 1e3,
        "worst_ms": s[-1] * 1e3,
    }


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(threads: int, busy: int, calls: int, tokens: int, method: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(E, I, H, generator=gen) / H**0.5).bfloat16()
    up = (torch.randn(E, I, H, generator=gen) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=gen) / I**0.5).bfloat16()
    layer = KTMoEWrapper(0, E, K, H, I, None, threads, 1, method=method)
    layer.load_weights_from_tensors(gate, up, down)
    hidden = torch.randn(tokens, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1)
    alone = summary(latencies(layer, hidden, ids, weights, calls))
    procs = busy_processes(busy)
    try:
        time.sleep(0.2)
        beside = summary(latencies(layer, hidden, ids, weights, calls))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return {
        "threads": threads,
        "busy": busy,
        "cores": physical_cores(),
        "tokens": tokens,
        "method": method,
        "calls": calls,
        "alone": alone,
        "beside_busy": beside,
        "median_ratio": beside["median_ms"] / alone["median_ms"],
        "p90_over_median_alone": beside["p90_ms"] / alone["median_ms"],
        "worst_over_median_alone": beside["worst_ms"] / alone["median_ms"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=physical_cores())
    p.add_argument("--busy", type=int, default=1)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--method", default="AMXINT4")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    r = measure(args.threads, args.busy, args.calls, args.tokens, args.method)
    print(
        f"{r['method']}, T={r['tokens']}, {r['threads']} engine threads on {r['cores']} cores, "
        f"{r['busy']} busy process(es), {r['calls']} calls"
    )
    print("| | median ms | p90 ms | worst ms |")
    print("|---|---|---|---|")
    for name in ("alone", "beside_busy"):
        s = r[name]
        print(f"| {name} | {s['median_ms']:.3f} | {s['p90_ms']:.3f} | {s['worst_ms']:.3f} |")
    print(
        f"beside / alone: median {r['median_ratio']:.2f}x, p90 {r['p90_over_median_alone']:.2f}x, "
        f"worst {r['worst_over_median_alone']:.2f}x (of the median alone)"
    )
    if args.out:
        args.out.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
