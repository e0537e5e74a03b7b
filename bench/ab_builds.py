"""Interleaved A/B timing of several builds of the native engine in one process.

On a shared VM the matrix-unit and memory speeds drift by 2-3x over minutes, so two builds timed
one after the other compare the minutes, not the builds. This loads each build's extension side by
side and alternates their forward calls, so every build sees the same moments.

Each build needs its own pybind11 registry (two modules registering the same C++ types otherwise
clash) and its own build directory:

    CXXFLAGS='-DPYBIND11_COMPILER_TYPE=\\"old\\"' pip install --no-deps --no-build-isolation \\
        --target /tmp/ab/old --config-settings=build-dir=/tmp/ab/build_old <source tree>

    python bench/ab_builds.py --method AMXINT8 --tokens 2048 /tmp/ab/old /tmp/ab/new

A build may name its quantization group as DIR@GROUP (default: the method's), to compare group sizes.

Prints each build's median forward time and its speed relative to the first build, after checking
that the builds agree on the output.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import statistics
import time

import torch

LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 64, 8)}


def load_native(install_dir: str, index: int):
    paths = glob.glob(f"{install_dir}/kt_sglang/_native*.so")
    if not paths:
        raise SystemExit(f"{install_dir}: no kt_sglang/_native*.so (pip install --target it first)")
    spec = importlib.util.spec_from_file_location(f"build{index}._native", paths[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "builds", nargs="+", help="install directories (pip install --target), each DIR or DIR@GROUP"
    )
    p.add_argument("--layer", choices=sorted(LAYERS), default="qwen3-30b-a3b")
    p.add_argument("--method", default="BF16", help="a --kt-method name every build has")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--calls", type=int, default=15, help="timed calls per build")
    p.add_argument("--copies", type=int, default=1, help="weight copies per build, cycled (decode: ~8)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", help="kernel family (scalar, avx2, avx512, amx; default: the best here)")
    args = p.parse_args()

    H, I, E, k = LAYERS[args.layer]
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(E, I, H, generator=gen) / H**0.5).bfloat16()
    up = (torch.randn(E, I, H, generator=gen) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=gen) / I**0.5).bfloat16()
    T = args.tokens
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int()
    weights = torch.rand(T, k, generator=gen)

    builds = []
    for i, spec in enumerate(args.builds):
        path, _, group_text = spec.partition("@")
        native = load_native(path, i)
        runner = native.Runner([(0, list(range(args.threads)))])
        workspace = native.Workspace()
        group = int(group_text or 0)  # 0: the method's default
        layers = []
        for _ in range(args.copies):
            layer = native.MoeLayer(
                runner,
                workspace,
                E,
                k,
                H,
                I,
                getattr(native.Method, args.method),
                group,
                args.isa or native.best_isa(),
                4096,
            )
            layer.load_dense(gate.data_ptr(), up.data_ptr(), down.data_ptr(), native.DType.bfloat16, E, [])
            layers.append(layer)
        builds.append({"path": spec, "runner": runner, "layers": layers, "out": torch.empty(T, H).bfloat16()})

    def forward(build: dict, copy: int) -> None:
        layer = build["layers"][copy % len(build["layers"])]
        ptrs = (x.data_ptr(), ids.data_ptr(), False, weights.data_ptr(), 0, build["out"].data_ptr(), False)
        layer.submit_forward(T, 0, *ptrs)
        build["runner"].sync(0)

    for b in builds:
        forward(b, 0)
    reference = builds[0]["out"].float()
    for b in builds[1:]:
        diff = ((b["out"].float() - reference).norm() / reference.norm()).item()
        print(f"{b['path']} vs {builds[0]['path']}: relative difference {diff:.2e}")

    times = {b["path"]: [] for b in builds}
    for _ in range(args.calls):
        for b in builds:
            for c in range(args.copies):
                t = time.perf_counter()
                forward(b, c)
                times[b["path"]].append(time.perf_counter() - t)
    base = statistics.median(times[builds[0]["path"]])
    for b in builds:
        m = statistics.median(times[b["path"]])
        print(
            f"{args.layer} {args.method} T={T} {args.isa or native.best_isa()} {b['path']}: "
            f"{m * 1e3:.2f} ms, {T / m:.0f} tok/s, x{base / m:.3f}"
        )


if __name__ == "__main__":
    main()
