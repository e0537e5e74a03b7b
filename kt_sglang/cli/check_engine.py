"""`kt-sglang check-engine`: the CPU expert engine alone on a small MoE layer, against float32.

It builds a Qwen3-MoE-shaped layer (scaled down), runs a decode step and a prefill chunk with every
method, and prints the error against the float32 reference and the time of each.
"""

from __future__ import annotations

import time

import torch


def run_check_engine(threads: int | None = None) -> int:
    from kt_sglang.engine import KTMoEWrapper
    from kt_sglang.engine.canonical import random_experts
    from kt_sglang.engine.methods import METHODS
    from kt_sglang.engine.native import _native
    from kt_sglang.engine.pools import physical_cores
    from kt_sglang.engine.reference import moe_reference, relative_error

    threads = threads or physical_cores()
    H, I, E, k = 1024, 384, 32, 4
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(E, I, H, generator=gen) / H**0.5
    up = torch.randn(E, I, H, generator=gen) / H**0.5
    down = torch.randn(E, H, I, generator=gen) / I**0.5
    print(
        f"kt-sglang CPU engine check: {_native.cpu_features()['brand']}, kernels: {_native.selected_isa()}, "
        f"{threads} thread(s)"
    )
    print(f"layer: {E} experts, top-{k}, hidden {H}, intermediate {I}")
    ok = True
    for method, info in METHODS.items():
        bound = info.error_bound
        layer = KTMoEWrapper(0, E, k, H, I, None, threads, 1, method=method)
        ref_weights = (gate, up, down)
        if info.quantizes_dense:
            layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
        else:  # checkpoint values, against float32 on the same values
            mats, ref_weights = random_experts(method, E, I, H)
            layer.load_canonical(*mats)
        for T in (1, 256):
            x = torch.randn(T, H, generator=gen).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
            w = torch.softmax(torch.randn(T, k, generator=gen), -1)
            layer.forward(x, ids, w)
            t = time.perf_counter()
            out = layer.forward(x, ids, w)
            dt = time.perf_counter() - t
            err = relative_error(out, moe_reference(x, *ref_weights, ids, w))
            ok &= err <= bound
            print(
                f"  {method.value:14s} T={T:4d}: {dt * 1e3:7.2f} ms  "
                f"rel. error vs float32 {err:.4f} (bound {bound:g})"
            )
    print("result: " + ("all methods within their error bounds" if ok else "ERROR BOUND EXCEEDED"))
    return 0 if ok else 1
