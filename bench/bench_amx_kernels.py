"""One core's AMX GEMM kernels at the layers' shapes, calls interleaved: the per-core rates the AMX
issue's targets name, without the rest of the layer.

For each shape (Qwen3-30B-A3B and DeepSeek-V3 gate/up and down) and row count it times, alternating
call by call (a shared VM's tile unit drifts 2-3x within minutes, so only calls from the same moments
compare):

  int4-group   AMXINT4, int8 rows with a scale per group: the group kernel (an epilogue per group)
  int4-whole-k AMXINT4, int8 rows with one scale per row: from 64 rows the kernel that requantizes
               the panels per channel and sums all of K in the tiles (docs/engine.md)
  int4-a16     AMXINT4, bf16 rows: the panels dequantized to bf16, then tdpbf16ps over all of K
  int8-group   AMXINT8, int8 rows with a scale per group
  bf16         BF16 weights, bf16 rows

and prints one JSON object: median TOPS (TFLOPS for bf16) per kernel, shape and rows, and
int4-whole-k over int4-group. Run it on one thread of a host with AMX (`--isa amx-emu` runs the tile
unit's software model instead: a dry run, not a timing):

    python bench/bench_amx_kernels.py --out amx_kernels.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kt_sglang.engine.canonical import quantize
from kt_sglang.engine.native import _native

# (name, K, N): gate/up computes 2 x intermediate channels over the hidden size, down the reverse
SHAPES = {
    "qwen3-gate-up": (2048, 1536),
    "qwen3-down": (768, 2048),
    "deepseek-gate-up": (7168, 4096),
    "deepseek-down": (2048, 7168),
}
GROUP = 64


def packed_panels(method: str, w: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    canon = quantize(method, w.bfloat16(), GROUP)
    out = torch.zeros(_native.packed_bytes(getattr(_native.Method, method), GROUP, N, K), dtype=torch.uint8)
    ptrs = [t.data_ptr() if t is not None else 0 for t in (canon.weight, canon.scales, canon.mins)]
    _native.pack_matrix(getattr(_native.Method, method), GROUP, N, K, *ptrs, out.data_ptr())
    return out


def int8_rows(x: torch.Tensor, per_row: bool):
    m, K = x.shape
    q = torch.empty(m, K, dtype=torch.int8)
    scales, sums = torch.empty(m, K // GROUP), torch.empty(m, K // GROUP)
    _native.quantize_activations(
        x.data_ptr(), m, K, GROUP, q.data_ptr(), scales.data_ptr(), sums.data_ptr(), per_row=per_row
    )
    return q, scales, sums


def run(isa: str, shapes: list[str], rows: list[int], calls: int) -> dict:
    results = {}
    for name in shapes:
        K, N = SHAPES[name]
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) / K**0.5
        panels = {m: packed_panels(m, w) for m in ("AMXINT4", "AMXINT8", "BF16")}
        for m in rows:
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
            c = torch.empty(-(-m // 32) * 32, N)
            grouped, per_row, x16 = int8_rows(x, False), int8_rows(x, True), x.bfloat16()
            kernels = {
                "int4-group": ("AMXINT4", True, grouped),
                "int4-whole-k": ("AMXINT4", True, per_row),
                "int4-a16": ("AMXINT4", False, (x16, None, None)),
                "int8-group": ("AMXINT8", True, grouped),
                "bf16": ("BF16", False, (x16, None, None)),
            }
            times = {k: [] for k in kernels}
            for _ in range(calls):
                for kernel, (method, int8, (a, s, su)) in kernels.items():
                    t = time.perf_counter()
                    _native.gemm(
                        isa,
                        getattr(_native.Method, method),
                        int8,
                        m,
                        K,
                        GROUP,
                        a.data_ptr(),
                        s.data_ptr() if s is not None else 0,
                        su.data_ptr() if su is not None else 0,
                        panels[method].data_ptr(),
                        N // 16,
                        c.data_ptr(),
                    )
                    times[kernel].append(time.perf_counter() - t)
            point = {k: 2 * m * K * N / statistics.median(v) / 1e12 for k, v in times.items()}
            point["whole_k_over_group"] = point["int4-whole-k"] / point["int4-group"]
            results[f"{name}/m{m}"] = {k: float(f"{v:.4g}") for k, v in point.items()}
            print(name, m, results[f"{name}/m{m}"], flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", default="amx", help="amx (the tile unit) or amx-emu (its model: a dry run)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[32, 64, 128, 512])
    p.add_argument("--calls", type=int, default=30, help="calls per kernel and point (medians)")
    p.add_argument("--out", help="write the JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {"isa": args.isa, "group": GROUP, "unit": "TOPS (bf16: TFLOPS)", "points": {}}
    results["points"] = run(args.isa, args.shapes, args.rows, args.calls)
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
