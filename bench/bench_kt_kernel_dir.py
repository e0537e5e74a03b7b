"""A directory kt-kernel converted, served two ways, timed interleaved in one process.

kt-kernel 0.7.2 writes a layer of random experts (``tests/kt_kernel_dirs_worker.py write``, in the
environment ``--kt-kernel-python`` names); then

- ``kt-kernel dir``: ``KTMoEWrapper(weight_path=<the directory>)`` as a kt-kernel user runs it: int8
  inputs with one scale per token / row of h, whole-K AMX kernels (kt-kernel's numerics);
- ``groups``: the same weights loaded as canonical matrices into a layer of the same method and
  group, computed as the engine's own AMXINT8 / AMXINT4 layers are (inputs per group of 128).

    python bench/bench_kt_kernel_dir.py --kt-kernel-python .venv/bin/python-kt-kernel \\
        --method AMXINT8 --tokens 128 512 2048 --out kt_kernel_dir.json

Prints the median forward time of each per token count, their ratio and their agreement; ``--out``
writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kt_sglang import KTMoEWrapper
from kt_sglang.weights.kt_kernel_files import KtKernelDir

LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}
WORKER = Path(__file__).resolve().parents[1] / "tests" / "kt_kernel_dirs_worker.py"
GROUP = 128


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kt-kernel-python", required=True, help="a Python that imports kt-kernel 0.7.2")
    parser.add_argument("--layer", choices=sorted(LAYERS), default="qwen3-30b-a3b")
    parser.add_argument("--experts", type=int, help="fewer routed experts than the model's (faster to write)")
    parser.add_argument("--method", choices=("AMXINT8", "AMXINT4"), default="AMXINT8")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    H, I, E, K = LAYERS[args.layer]
    E = args.experts or E
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kt-kernel"
        print(f"kt-kernel writes {E} experts of {H} x {I} ({args.method}) ...", flush=True)
        subprocess.run(
            [
                args.kt_kernel_python,
                str(WORKER),
                "write",
                str(path),
                args.method,
                "1",
                str(H),
                str(I),
                str(E),
                "7",
            ],
            check=True,
        )
        common = dict(chunked_prefill_size=max(args.tokens), method=args.method)
        served = KTMoEWrapper(0, E, K, H, I, None, args.threads, 1, weight_path=str(path), **common)
        served.load_weights()
        groups = KTMoEWrapper(0, E, K, H, I, None, args.threads, 1, group_size=GROUP, **common)
        mats = [KtKernelDir(path).read(0, p, list(range(E)), H, I, GROUP) for p in ("gate", "up", "down")]
        groups.load_canonical(*mats)
        del mats
        layers = {"kt-kernel dir": served, "groups": groups}
        results = []
        for tokens in args.tokens:
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, H, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
            w = torch.softmax(torch.randn(tokens, K, generator=g), -1)
            outs = {name: layer.forward(x, ids, w).float() for name, layer in layers.items()}
            times: dict[str, list[float]] = {name: [] for name in layers}
            for _ in range(args.repeats):
                for name, layer in layers.items():
                    start = time.perf_counter()
                    layer.forward(x, ids, w)
                    times[name].append(time.perf_counter() - start)
            median = {name: statistics.median(t) for name, t in times.items()}
            a, b = outs["kt-kernel dir"], outs["groups"]
            row = {
                "tokens": tokens,
                "ms": {name: 1e3 * t for name, t in median.items()},
                "speedup": median["groups"] / median["kt-kernel dir"],
                "relative_difference": float((a - b).norm() / b.norm()),
            }
            results.append(row)
            print(
                f"{tokens:5d} tokens: kt-kernel dir {row['ms']['kt-kernel dir']:.2f} ms, groups "
                f"{row['ms']['groups']:.2f} ms, x{row['speedup']:.2f} (outputs differ by "
                f"{row['relative_difference']:.4f})",
                flush=True,
            )
    if args.out:
        meta = {"layer": args.layer, "experts": E, "method": args.method, "threads": args.threads}
        args.out.write_text(json.dumps({**meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
