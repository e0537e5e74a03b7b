"""Decode step of a stack of hybrid MoE layers, on the CPU device or with the hot part on a GPU.

    python bench/bench_hybrid.py [--layers 4] [--tokens 1] [--method AMXINT4] [--device cpu|cuda]
                                 [--out FILE]

Qwen3-30B-A3B layer shapes (H 2048, I 768, 128 experts, top-8), a few layers. For each hot fraction
(0 / 25 / 50%) and deferral (0, 1, 2, 4): median time of a whole step, the deferral speedup against
deferral 0, and the overlap of the hot ("GPU") part with the CPU engine:
overlap = (t_hot_only + t_cpu_only - t_step) / min(t_hot_only, t_cpu_only). On a CPU-only machine both
parts share the same cores, so little overlap is possible; the numbers say how much. With
``--device cuda`` the hot experts and the split run as Triton kernels and the engine in stream order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.pools import physical_cores, reserved_cores, serving_threads
from kt_sglang.kernels import hot_moe, split_routing
from kt_sglang.layer import DeferralChain, HybridMoELayer

H, I, E, K = 2048, 768, 128, 8


def build(n_layers: int, hot_fraction: float, deferral: int, sources, device: str):
    chain = DeferralChain()
    layers = []
    n_hot = int(E * hot_fraction)
    for n in range(n_layers):
        gate, up, down, experts = sources[n]
        slot_of = torch.full((E,), -1)
        slot_of[:n_hot] = torch.arange(n_hot)
        w13 = torch.cat([gate[:n_hot], up[:n_hot]], 1).to(device)
        layer = HybridMoELayer(experts, slot_of.to(device), w13, down[:n_hot].to(device), chain, deferral)
        layers.append(layer)
    HybridMoELayer.link(layers)
    return layers


def step_time(layers, x, routes, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        h = x
        for layer, (ids, w) in zip(layers, routes, strict=True):
            h = layer(h, ids, w)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--method", default="AMXINT4")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    # The serving rule (kt_sglang.engine.pools.reserved_cores): the engine leaves a quarter of the cores
    # to the threads that launch, wait and run torch's own work (the hot part on the CPU device).
    torch.set_num_threads(reserved_cores())
    gen = torch.Generator().manual_seed(0)
    sources = []
    for n in range(args.layers):
        gate = (torch.randn(E, I, H, generator=gen) / H**0.5).bfloat16()
        up = (torch.randn(E, I, H, generator=gen) / H**0.5).bfloat16()
        down = (torch.randn(E, H, I, generator=gen) / I**0.5).bfloat16()
        experts = KTMoEWrapper(n, E, K, H, I, None, serving_threads(), 1, method=args.method)
        experts.load_weights_from_tensors(gate, up, down)
        sources.append((gate, up, down, experts))
    x = torch.randn(args.tokens, H, generator=gen).bfloat16().to(args.device)
    routes = []
    for _ in range(args.layers):
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(args.tokens)])
        weights = torch.softmax(torch.randn(args.tokens, K, generator=gen), -1)
        routes.append((ids.to(args.device), weights.to(args.device)))
    rows = []
    for hot in (0.0, 0.25, 0.5):
        base = None
        for deferral in (0, 1, 2, 4):
            layers = build(args.layers, hot, deferral, sources, args.device)
            step_time(layers, x, routes, 2)
            t = step_time(layers, x, routes, args.repeats)
            base = base or t
            rows.append({"hot_fraction": hot, "deferral": deferral, "step_ms": t * 1e3, "speedup": base / t})
    # Overlap at 50% hot, deferral 0: each part alone, then together.
    half_layers = build(args.layers, 0.5, 0, sources, args.device)
    step = next(r["step_ms"] for r in rows if r["hot_fraction"] == 0.5 and r["deferral"] == 0) / 1e3
    hot_alone = step_time([_Part(layer, hot=True) for layer in half_layers], x, routes, args.repeats)
    cpu_alone = step_time([_Part(layer, hot=False) for layer in half_layers], x, routes, args.repeats)
    overlap = (hot_alone + cpu_alone - step) / min(hot_alone, cpu_alone)
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "method": args.method,
        "layers": args.layers,
        "tokens": args.tokens,
        "engine_threads": serving_threads(),
        "torch_threads": reserved_cores(),
        "rows": rows,
        "half_hot": {
            "hot_ms": hot_alone * 1e3,
            "cpu_ms": cpu_alone * 1e3,
            "step_ms": step * 1e3,
            "overlap": overlap,
        },
    }
    print(
        f"{args.layers} layers, T={args.tokens}, {args.method}, {physical_cores()} cores "
        f"(engine {serving_threads()}, torch {reserved_cores()}), {result['device']}"
    )
    print("| hot | deferral | step ms | speedup vs deferral 0 |")
    print("|---|---|---|---|")
    for r in rows:
        hot = int(r["hot_fraction"] * 100)
        print(f"| {hot}% | {r['deferral']} | {r['step_ms']:.2f} | {r['speedup']:.2f}x |")
    print(
        f"50% hot, deferral 0: hot part alone {hot_alone * 1e3:.2f} ms, "
        f"CPU part alone {cpu_alone * 1e3:.2f} ms, both {step * 1e3:.2f} ms, overlap {overlap:.2f}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


class _Part:
    """One part of a hybrid layer alone: the hot experts (what a GPU would do) or the CPU engine's."""

    def __init__(self, layer: HybridMoELayer, hot: bool) -> None:
        self.layer, self.hot = layer, hot

    def __call__(self, h, ids, w):
        split = split_routing(ids, w, self.layer.gpu_slot_of, 0)
        if self.hot:
            return hot_moe(h, self.layer.w13, self.layer.w2, split.hot_ids, w).to(h.dtype)
        stream = torch.cuda.current_stream() if h.is_cuda else None
        return self.layer.experts.forward(h, split.cold_ids, w, stream)


if __name__ == "__main__":
    main()
