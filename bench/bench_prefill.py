"""Prompt chunks through MoE layers: the CPU engine against the GPU prefill that streams the packed experts.

    python bench/bench_prefill.py [--model qwen3-30b-a3b|deepseek-v3|tiny] [--layers 3]
        [--methods AMXINT4 AMXINT8 BF16] [--chunks 512 2048 8192 32768] [--device cuda|cpu]
        [--cpu-max-chunk 2048] [--buffer-gib G] [--repeats 3] [--out FILE]

Per method and chunk size, prompt tokens/s per layer of: the CPU engine (every expert on the CPU, the
layer's experts routed uniformly at random; chunks above ``--cpu-max-chunk`` take the rate measured at
that size, where it has saturated) and the streaming path (`GpuPrefill`, threshold 1, ``--layers``
layers in turn so that no layer is still staged from the pass before). For the streaming path also:
the achieved host-to-device rate against the pinned-memory peak measured in the same run, the copies
alone (staging every layer, no compute), the compute alone (a second pass over two layers, both still
staged: no copies) and their overlap ``(copy + compute - both) / min(copy, compute)`` (1: the shorter
hides entirely), the GPU memory the path held, the crossover measured (the smallest chunk where
streaming is faster) and the one ``--kt-gpu-prefill-token-threshold auto`` computes.

DeepSeek-V3 keeps its layer's shapes with 64 of its 256 routed experts, as bench_decode_step.py does.
On the CPU device the streaming path runs its torch twins in host memory: CI runs it as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_decode_step import SHAPES

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.canonical import random_canonical
from kt_sglang.engine.methods import METHODS, parse_method
from kt_sglang.engine.pools import physical_cores, reserved_cores, serving_threads
from kt_sglang.layer import DeferralChain, GpuPrefill, HybridMoELayer
from kt_sglang.layer.prefill import crossover, measure_h2d_gbps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    times = []
    for i in range(repeats + 1):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def build_layers(s, method: str, layers: int, device: torch.device) -> list[HybridMoELayer]:
    gen = torch.Generator().manual_seed(0)
    chain, out = DeferralChain(), []
    for n in range(layers):
        experts = KTMoEWrapper(
            n, s.experts, s.top_k, s.hidden, s.inter, None, serving_threads(), 1, method=method
        )
        if METHODS[parse_method(method)].quantizes_dense:
            mats = [
                (torch.randn(s.experts, N, K, generator=gen) / K**0.5).bfloat16()
                for N, K in ((s.inter, s.hidden), (s.inter, s.hidden), (s.hidden, s.inter))
            ]
            experts.load_weights_from_tensors(*mats)
        else:
            experts.load_canonical(
                *(
                    [random_canonical(method, N, K, seed=1000 * n + 3 * e + j) for e in range(s.experts)]
                    for j, (N, K) in enumerate(
                        ((s.inter, s.hidden), (s.inter, s.hidden), (s.hidden, s.inter))
                    )
                )
            )
        empty = torch.zeros(0, 0, 0, device=device)
        slot_of = torch.full((s.experts,), -1, device=device)
        out.append(HybridMoELayer(experts, slot_of, empty, empty, chain, 0, 0))
    HybridMoELayer.link(out)
    return out


def routing(tokens: int, experts: int, top_k: int, device: torch.device, gen: torch.Generator):
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    weights = torch.full((tokens, top_k), 1.0 / top_k)
    return ids.to(device), weights.to(device)


def bench_method(args, s, method: str, device: torch.device, peak_gbps: float | None) -> dict:
    layers = build_layers(s, method, args.layers, device)
    gen = torch.Generator().manual_seed(1)
    cpu_rates: dict[int, float] = {}
    for chunk in sorted(c for c in args.chunks if c <= args.cpu_max_chunk) or [min(args.chunks)]:
        x = (torch.randn(chunk, s.hidden, generator=gen) / 4).bfloat16()
        ids, weights = routing(chunk, s.experts, s.top_k, torch.device("cpu"), gen)
        engine = layers[0].experts.forward
        t = timed(lambda f=engine, x=x, ids=ids, w=weights: f(x, ids, w), args.repeats, torch.device("cpu"))
        cpu_rates[chunk] = chunk / t
    largest = max(cpu_rates)
    buffer = None if args.buffer_gib is None else int(args.buffer_gib * 2**30)
    prefill = GpuPrefill(1, device, buffer)
    HybridMoELayer.enable_gpu_prefill(layers, prefill)
    layer_bytes = len(layers[0].prefill_source.held) * layers[0].prefill_source.expert_bytes()
    rows = []
    for chunk in args.chunks:
        x = (torch.randn(chunk, s.hidden, generator=gen) / 4).bfloat16().to(device)
        routes = [routing(chunk, s.experts, s.top_k, device, gen) for _ in layers]

        def stack(layers=layers, x=x, routes=routes):
            for layer, (ids, weights) in zip(layers, routes, strict=True):
                layer(x, ids, weights)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = prefill.stats.bytes_copied
        both = timed(stack, args.repeats, device) / len(layers)
        copied = (prefill.stats.bytes_copied - before) / (args.repeats + 1) / len(layers)
        copy = timed(lambda: copy_only(prefill, layers), args.repeats, device) / len(layers)

        def staged_pair(pair=layers[:2], x=x, routes=routes):  # both stay staged: no copies
            for layer, (ids, weights) in zip(pair, routes, strict=False):
                layer(x, ids, weights)

        compute = timed(staged_pair, args.repeats, device) / 2
        cpu_rate = cpu_rates.get(chunk, cpu_rates[largest])
        rows.append({
            "chunk": chunk,
            "cpu_tokens_per_s": cpu_rate,
            "cpu_rate_measured_at": chunk if chunk in cpu_rates else largest,
            "stream_tokens_per_s": chunk / both,
            "speedup": chunk / both / cpu_rate,
            "stream_ms": both * 1e3,
            "copy_ms": copy * 1e3,
            "compute_ms": compute * 1e3,
            "overlap": (copy + compute - both) / min(copy, compute) if min(copy, compute) > 0 else 0.0,
            "h2d_gbps": copied / both / 1e9 if device.type == "cuda" else None,
            "h2d_of_peak": copied / both / 1e9 / peak_gbps if peak_gbps else None,
            "gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        })  # fmt: skip
    faster = [r["chunk"] for r in rows if r["speedup"] > 1]
    auto = crossover(peak_gbps, cpu_rates[largest], layer_bytes).threshold if peak_gbps else None
    return {
        "method": method,
        "layer_bytes": layer_bytes,
        "rows": rows,
        "crossover_measured": min(faster) if faster else None,
        "threshold_auto": auto,
    }


def copy_only(prefill: GpuPrefill, layers: list[HybridMoELayer]) -> None:
    """Every layer's cold experts into the staging buffer, in turn, with no compute."""
    for layer in layers:
        for experts in prefill._rounds(layer.prefill_source, layer.hot_experts):
            half = prefill._stage(layer.prefill_source, experts, None)
            half.consumed = None
    for half in prefill._halves:  # nothing stays staged for the next measurement
        half.source = half.experts = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=["AMXINT4", "AMXINT8", "BF16"])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--cpu-max-chunk", type=int, default=2048, help="larger chunks take this size's CPU rate")
    p.add_argument(
        "--buffer-gib", type=float, default=None, help="the staging buffer's cap (default: two layers)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.layers < 3:
        p.error("--layers must be at least 3 (with two, both stay staged and nothing is copied)")
    s = SHAPES[args.model]
    device = torch.device(args.device)
    torch.set_num_threads(reserved_cores())  # the serving rule: torch's own work beside the engine's

    peak = measure_h2d_gbps(device) if device.type == "cuda" else None
    results = [bench_method(args, s, method, device, peak) for method in args.methods]
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": args.model,
        "layers": args.layers,
        "engine_threads": serving_threads(),
        "cores": physical_cores(),
        "pinned_h2d_gbps": peak,
        "methods": results,
    }
    engine = f"{physical_cores()} cores (engine {serving_threads()} threads)"
    pinned = f", pinned host-to-device {peak:.1f} GB/s" if peak else ""
    print(f"{args.model} layers, {engine}, {result['device']}{pinned}")
    columns = "CPU engine tok/s | streamed tok/s (x) | copy / compute / both ms | overlap | H2D GB/s"
    print(f"| method | chunk | {columns} |")
    print("|---|---|---|---|---|---|---|")
    for m in results:
        for r in m["rows"]:
            h2d = f"{r['h2d_gbps']:.1f} ({r['h2d_of_peak'] * 100:.0f}%)" if r["h2d_gbps"] else "-"
            rates = f"{r['cpu_tokens_per_s']:,.0f} | {r['stream_tokens_per_s']:,.0f} ({r['speedup']:.2f})"
            times = f"{r['copy_ms']:.2f} / {r['compute_ms']:.2f} / {r['stream_ms']:.2f}"
            print(f"| {m['method']} | {r['chunk']} | {rates} | {times} | {r['overlap']:.2f} | {h2d} |")
        print(f"{m['method']}: crossover measured {m['crossover_measured']}, auto {m['threshold_auto']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
