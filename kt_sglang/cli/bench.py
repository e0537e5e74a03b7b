"""`kt-sglang bench`: one MoE layer on the CPU engine, against an in-run torch baseline.

Reports decode latency (T = 1, 4, 16) and prefill tokens/s (T = 128, 512, 2048) per method, the
effective bandwidth (bytes of the experts a call touches / its time) as a fraction of the read
bandwidth, effective TOPS (2 * T * k * 3 * H * I / time) and the relative error against the float32
reference. Layer weights are cycled over enough copies that the working set exceeds the last-level
cache. Medians over repeats; JSON out.

A shared host's memory and matrix speeds drift by 2-3x within minutes, so every ratio is taken
between measurements interleaved in time: each decode point alternates its calls with read
bandwidth probes, and each prefill point alternates its calls with the torch baseline's. With
`--kt-kernel-python`, kt-kernel 0.7.2 runs the same layer in a process of its own environment
(ktkernel_worker.py), its calls alternating with ours at every point.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kt_sglang.engine.methods import method_names

LAYERS = {
    # name: (hidden, intermediate, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 64, 8),
    "quick": (1024, 384, 32, 4),
}
DECODE_TOKENS = (1, 4, 16)
PREFILL_TOKENS = (128, 512, 2048)


@dataclass
class BenchConfig:
    layers: list[str] = field(default_factory=lambda: ["qwen3-30b-a3b", "deepseek-v3"])
    methods: list[str] = field(default_factory=lambda: method_names())
    threads: list[int] = field(default_factory=lambda: [2])
    decode_tokens: list[int] = field(default_factory=lambda: list(DECODE_TOKENS))
    prefill_tokens: list[int] = field(default_factory=lambda: list(PREFILL_TOKENS))
    working_set_gib: float = 2.0
    repeats: int = 7
    baseline: bool = True
    kt_kernel_python: str | None = None  # interpreter of an environment with kt-kernel installed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a small layer, few repeats (seconds)")
    p.add_argument("--layers", nargs="+", choices=sorted(LAYERS), help="layer shapes to run")
    p.add_argument("--methods", nargs="+", choices=method_names(), help="methods to run (default: all)")
    p.add_argument("--threads", nargs="+", type=int, help="thread counts (default: 2)")
    p.add_argument("--decode-tokens", nargs="+", type=int, help="decode batch sizes (default 1 4 16)")
    p.add_argument("--prefill-tokens", nargs="+", type=int, help="prefill sizes (default 128 512 2048)")
    p.add_argument("--repeats", type=int, help="timed repeats per point (median reported)")
    p.add_argument("--working-set-gib", type=float, help="cycle weights over at least this many GiB")
    p.add_argument("--no-baseline", action="store_true", help="skip the torch per-expert baseline")
    p.add_argument(
        "--kt-kernel-python",
        metavar="PY",
        help="Python of an environment with kt-kernel 0.7.2 installed: run its layer side by side, "
        "interleaved with ours, and report our speed over its",
    )
    p.add_argument("--out", type=Path, help="write the JSON results here")


def run_from_args(args: argparse.Namespace) -> int:
    cfg = BenchConfig()
    if args.quick:
        cfg = BenchConfig(
            layers=["quick"],
            threads=[min(2, _cores())],
            decode_tokens=[1, 16],
            prefill_tokens=[128],
            working_set_gib=0.0,
            repeats=3,
        )
    for name in (
        "layers",
        "methods",
        "threads",
        "decode_tokens",
        "prefill_tokens",
        "repeats",
        "working_set_gib",
        "kt_kernel_python",
    ):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.no_baseline:
        cfg.baseline = False
    try:
        results = run_benchmark(cfg)
    except KtKernelWorkerError as e:
        print(f"kt-sglang bench: {e}", file=sys.stderr)
        return 1
    print_table(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return 0


def _cores() -> int:
    from kt_sglang.engine.pools import physical_cores

    return physical_cores()


def read_bandwidth_gbs(threads: int, gib: float = 2.0, repeats: int = 5) -> float:
    """Read bandwidth of `threads` pinned threads streaming a buffer far larger than the caches."""
    from kt_sglang.engine.native import _native
    from kt_sglang.engine.pools import plan_pools

    cpus = list(plan_pools(threads, 1).cpus[0])
    return _native.measure_read_bandwidth(int(gib * 2**30), cpus, repeats)


def torch_dtype() -> torch.dtype:
    """The dtype of torch's side of the benchmark (its matmul rate and the per-expert loop): bf16
    where the CPU has bf16 arithmetic (AVX512-BF16, AMX), float32 elsewhere, where torch emulates
    bf16 products tens of times slower than its float32 ones."""
    from kt_sglang.engine.native import _native

    f = _native.cpu_features()
    native_bf16 = (f["avx512_bf16"] and f["os_avx512"]) or (f["amx_bf16"] and f["os_amx"])
    return torch.bfloat16 if native_bf16 else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def matmul_tflops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """torch (oneDNN) matmul rate in `torch_dtype()`: the machine's matrix-unit speed at the time of
    the run.

    On shared hosts the AMX rate of a vCPU varies ~3x over minutes (measured here: 0.35 to 1.0
    TFLOPS per core for this very call), so prefill figures are only comparable through it.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.randn(n, n).to(torch_dtype())
    b = torch.randn(n, n).to(torch_dtype())
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    torch.set_num_threads(old)
    return 2 * n**3 / statistics.median(times) / 1e12


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return ids, weights / weights.sum(-1, keepdim=True)


def _source_weights(hidden: int, inter: int, experts: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.empty(experts, inter, hidden, dtype=torch.bfloat16)
    up = torch.empty_like(gate)
    down = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
    for e in range(experts):  # one expert at a time keeps the float32 temporaries small
        gate[e] = torch.randn(inter, hidden, generator=gen) / hidden**0.5
        up[e] = torch.randn(inter, hidden, generator=gen) / hidden**0.5
        down[e] = torch.randn(hidden, inter, generator=gen) / inter**0.5
    return gate, up, down


def _interleaved_medians(
    forwards: list, inputs: list, calls: int, probes: dict, rounds: int = 1, warmup=False
):
    """Median time of `calls` calls cycling over `forwards` (one per copy of the weights) and over
    `inputs` (argument tuples), and per probe the median of the values it returns (a list) when
    run once before each of `rounds` equal slices of those calls.

    After the probes the host settles for 50 ms (torch's OpenMP workers spin for a while after a
    call) and, with `warmup`, one untimed call wakes the engine's sleeping workers and refills its
    caches: short calls right after a probe otherwise measured up to 2x slow."""
    times, probed = [], {name: [] for name in probes}
    per_round = -(-calls // rounds)
    for r in range(rounds):
        for name, probe in probes.items():
            probed[name] += probe(per_round)
        if probes:
            time.sleep(0.05)
            if warmup:
                forwards[-1](*inputs[-1])
        for i in range(r * per_round, (r + 1) * per_round):
            t = time.perf_counter()
            forwards[i % len(forwards)](*inputs[i % len(inputs)])
            times.append(time.perf_counter() - t)
    return statistics.median(times), {name: statistics.median(v) for name, v in probed.items()}


def _timed_once(fn, args: tuple, _calls: int) -> list[float]:
    t = time.perf_counter()
    fn(*args)
    return [time.perf_counter() - t]


def _routed_input(T: int, H: int, E: int, k: int, gen: torch.Generator):
    return (torch.randn(T, H, generator=gen).bfloat16(), *_routing(T, E, k, gen))


def _measure_points(
    row, forwards, bytes_per_expert, layer, threads, cfg: BenchConfig, gen, baseline=None, kt_kernel=None
) -> None:
    """Fills row["decode"] / row["prefill"]: median time per batch size, cycling the weight copies.

    Decode points interleave read bandwidth probes with their calls ("read_bandwidth_gbs" of the
    point); prefill points interleave one call of `baseline` (the torch loop) per repeat. With
    `kt_kernel` (a KtKernelWorker holding this layer and method) each repeat also runs as many of
    its calls as of ours.
    """
    H, I, E, k = LAYERS[layer]
    for n, T in enumerate(cfg.decode_tokens + cfg.prefill_tokens):
        decode = T in cfg.decode_tokens
        # Decode cycles 16 routings: with one copy of the weights and one routing, the same few
        # experts would be re-read from the L3 every call.
        routings = 16 if decode else 1
        inputs = [_routed_input(T, H, E, k, gen) for _ in range(routings)]
        # decode: every copy of the weights at least twice per round of the bandwidth probe
        calls = cfg.repeats * max(2, 2 * len(forwards)) if decode else cfg.repeats
        probes = {}
        if decode:
            probes["bandwidth"] = lambda _calls: [read_bandwidth_gbs(threads, gib=0.5, repeats=2)]
        elif baseline is not None:
            probes["baseline"] = functools.partial(_timed_once, baseline, inputs[0])
        if kt_kernel is not None:
            probes["kt_kernel"] = functools.partial(kt_kernel.timed, T, routings=routings, seed=n)
        t, probed = _interleaved_medians(forwards, inputs, calls, probes, cfg.repeats, warmup=decode)
        # distinct experts' weights a call reads, averaged over the routings
        touched = statistics.mean(ids.unique().numel() for _, ids, _ in inputs) * bytes_per_expert
        point = {
            "ms": t * 1e3,
            "tokens_per_s": T / t,
            "eff_gbs": touched / t / 1e9,
            "tops": 2 * T * k * 3 * H * I / t / 1e12,
        }
        if decode:
            bw = probed["bandwidth"]
            point.update(read_bandwidth_gbs=bw, bw_fraction=touched / t / 1e9 / bw)
        elif "baseline" in probed:
            point.update(baseline_ms=probed["baseline"] * 1e3, vs_baseline=probed["baseline"] / t)
        if "kt_kernel" in probed:
            point.update(kt_kernel_ms=probed["kt_kernel"] * 1e3, vs_kt_kernel=probed["kt_kernel"] / t)
        (row["decode"] if decode else row["prefill"])[T] = point


class KtKernelWorkerError(RuntimeError):
    """kt-kernel's side of the benchmark cannot run (not installed, failed to load, exited)."""


class KtKernelWorker:
    """kt-kernel's layer in a process of the interpreter `python` (ktkernel_worker.py): same shapes,
    method and threads as ours, its calls interleaved with ours."""

    def __init__(self, python: str) -> None:
        script = Path(__file__).with_name("ktkernel_worker.py")
        try:
            self._proc = subprocess.Popen(
                [python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        except OSError as e:
            raise KtKernelWorkerError(f"--kt-kernel-python {python}: cannot start it ({e})") from e
        self.python = python
        self.versions = self._request(op="version")

    def _request(self, **request) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise KtKernelWorkerError(
                f"the kt-kernel worker ({self.python}) exited with {self._proc.wait()}; its stderr is above"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise KtKernelWorkerError(f"kt-kernel worker, {request['op']}: {reply['error']}")
        return reply

    def load(self, layer: str, method: str, threads: int, working_set_gib: float, max_tokens: int) -> dict:
        H, I, E, k = LAYERS[layer]
        return self._request(
            op="load",
            max_tokens=max_tokens,
            hidden=H,
            intermediate=I,
            experts=E,
            top_k=k,
            method=method,
            threads=threads,
            working_set_gib=working_set_gib,
        )

    def timed(self, tokens: int, calls: int, routings: int, seed: int) -> list[float]:
        return self._request(op="time", tokens=tokens, calls=calls, routings=routings, seed=seed)["seconds"]

    def __enter__(self) -> KtKernelWorker:
        return self

    def __exit__(self, *exc) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self._proc.stdin.close()
            self._proc.wait()


def _torch_moe(x, ids, weights, *, gate, up, down):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok].to(gate.dtype)
        h = torch.nn.functional.silu(xe @ gate[e].T) * (xe @ up[e].T)
        out.index_add_(0, tok, ((h @ down[e].T) * weights[tok, slot, None].to(h.dtype)).float())
    return out


def run_benchmark(cfg: BenchConfig) -> dict:
    from kt_sglang.engine.native import _native

    results: dict = {
        "machine": {
            "cpu": _native.cpu_features()["brand"],
            "isa": _native.selected_isa(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_dtype": dtype_name(torch_dtype()),
        },
        "config": asdict(cfg),
        "bandwidth_gbs": {},
        "matmul_tflops": {},
        "rows": [],
    }
    if cfg.kt_kernel_python:
        with KtKernelWorker(cfg.kt_kernel_python) as kt_kernel:
            results["machine"]["kt_kernel"] = kt_kernel.versions
    _run_layers(cfg, results)
    return results


def _run_layers(cfg: BenchConfig, results: dict) -> None:
    from kt_sglang.engine.reference import moe_reference

    gen = torch.Generator().manual_seed(1)
    for threads in cfg.threads:
        results["bandwidth_gbs"][threads] = read_bandwidth_gbs(threads)
        results["matmul_tflops"][threads] = [matmul_tflops(threads)]
    for layer in cfg.layers:
        H, I, E, k = LAYERS[layer]
        gate, up, down = _source_weights(H, I, E, seed=0)
        x_acc = torch.randn(64, H, generator=gen).bfloat16()
        ids_acc, w_acc = _routing(64, E, k, gen)
        accuracy = (x_acc, ids_acc, w_acc, moe_reference(x_acc, gate, up, down, ids_acc, w_acc))
        for threads in cfg.threads:
            baseline = None
            if cfg.baseline:
                row, baseline = _bench_baseline(layer, threads, gate, up, down, cfg, gen)
                results["rows"].append(row)
            for method in cfg.methods:
                if cfg.kt_kernel_python:
                    # A process per method (kt-kernel does not give a layer's memory back), loaded
                    # before ours so that the two loads' peaks never overlap.
                    with KtKernelWorker(cfg.kt_kernel_python) as kt_kernel:
                        max_tokens = max(cfg.decode_tokens + cfg.prefill_tokens)
                        loaded = kt_kernel.load(layer, method, threads, cfg.working_set_gib, max_tokens)
                        row = _bench_method(
                            layer, method, threads, (gate, up, down), accuracy, cfg, gen, baseline, kt_kernel
                        )
                        row["kt_kernel_copies"] = loaded["copies"]
                else:
                    row = _bench_method(
                        layer, method, threads, (gate, up, down), accuracy, cfg, gen, baseline
                    )
                results["rows"].append(row)
                results["matmul_tflops"][threads].append(matmul_tflops(threads))
        del gate, up, down


def _bench_method(
    layer, method, threads, weights, accuracy, cfg: BenchConfig, gen, baseline, kt_kernel=None
) -> dict:
    """Our layer with one method: its copies loaded, error measured, every point timed. A method
    that comes from checkpoints only runs random checkpoint values (its error is measured by the
    tests: a float32 copy of these layers would not fit in memory)."""
    from tqdm import tqdm

    from kt_sglang.engine import KTMoEWrapper, SharedRunner
    from kt_sglang.engine.canonical import random_canonical
    from kt_sglang.engine.methods import METHODS, parse_method
    from kt_sglang.engine.reference import relative_error

    H, I, E, k = LAYERS[layer]
    x_acc, ids_acc, w_acc, ref = accuracy
    SharedRunner.reset()
    if METHODS[parse_method(method)].quantizes_dense:

        def load(w):
            w.load_weights_from_tensors(*weights)

    else:
        shapes = ((I, H), (I, H), (H, I))
        mats = tuple([random_canonical(method, N, K, seed=e) for e in range(E)] for N, K in shapes)
        ref = None

        def load(w):
            w.load_canonical(*mats)

    first = KTMoEWrapper(0, E, k, H, I, None, threads, 1, method=method)
    load(first)
    copies = max(1, -(-int(cfg.working_set_gib * 2**30) // first.packed_bytes))
    layers = [first]
    for c in tqdm(range(1, copies), desc=f"{layer} {method}: layer copies", leave=False, disable=copies <= 1):
        w = KTMoEWrapper(c, E, k, H, I, None, threads, 1, method=method)
        load(w)
        layers.append(w)
    row = {
        "layer": layer,
        "method": method,
        "threads": threads,
        "isa": first.isa,
        "group_size": first.group_size,
        "copies": copies,
        "working_set_gib": copies * first.packed_bytes / 2**30,
        "decode": {},
        "prefill": {},
    }
    if ref is not None:
        row["rel_error"] = relative_error(first.forward(x_acc, ids_acc, w_acc), ref)
    first.forward(*_routed_input(16, H, E, k, gen))  # warm: scratch sized once
    forwards = [w.forward for w in layers]
    _measure_points(row, forwards, first.packed_bytes / E, layer, threads, cfg, gen, baseline, kt_kernel)
    return row


def _bench_baseline(layer, threads, gate, up, down, cfg: BenchConfig, gen):
    """Plain torch per-expert loop (in `torch_dtype()`) on `threads` intra-op threads, same shapes:
    its row, and one forward on the first weight copy for the methods' interleaved prefill ratios."""
    H, I, E, k = LAYERS[layer]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = torch_dtype()
    gate, up, down = (w.to(dtype) for w in (gate, up, down))
    copies = max(1, -(-int(cfg.working_set_gib * 2**30) // (gate.numel() * gate.element_size() * 3)))
    weights = [(gate, up, down)] + [(gate.clone(), up.clone(), down.clone()) for _ in range(copies - 1)]
    row = {
        "layer": layer,
        "method": f"torch-{dtype_name(dtype)}-baseline",
        "threads": threads,
        "copies": copies,
        "decode": {},
        "prefill": {},
    }
    forwards = [functools.partial(_torch_moe, gate=g, up=u, down=d) for g, u, d in weights]
    _measure_points(row, forwards, 3 * H * I * gate.element_size(), layer, threads, cfg, gen)
    torch.set_num_threads(old)

    def baseline(*args):
        torch.set_num_threads(threads)
        try:
            forwards[0](*args)
        finally:
            torch.set_num_threads(old)

    return row, baseline


def print_table(results: dict) -> None:
    print(f"CPU: {results['machine']['cpu']}, kernels: {results['machine']['isa']}")
    for threads, bw in results["bandwidth_gbs"].items():
        mm = results["matmul_tflops"][threads]
        print(
            f"{threads} thread(s): read bandwidth {bw:.1f} GB/s, torch "
            f"{results['machine'].get('torch_dtype', 'bf16')} matmul "
            f"{min(mm):.2f}-{max(mm):.2f} TFLOPS during the run"
        )
    header = (
        "| layer | method | threads | decode ms (T: ms, % of read BW) "
        "| prefill tok/s (T: tok/s, TOPS, x the torch loop and x kt-kernel, interleaved) | rel. error |"
    )
    print(header)
    print("|---|---|---|---|---|---|")
    for r in results["rows"]:
        dec = ", ".join(
            f"{T}: {p['ms']:.2f} ({100 * p['bw_fraction']:.0f}%"
            + (f", {p['vs_kt_kernel']:.2f}x kt-kernel)" if "vs_kt_kernel" in p else ")")
            for T, p in r["decode"].items()
        )
        pre = ", ".join(
            f"{T}: {p['tokens_per_s']:.0f} ({p['tops']:.2f}"
            + (f", {p['vs_baseline']:.2f}x loop" if "vs_baseline" in p else "")
            + (f", {p['vs_kt_kernel']:.2f}x kt-kernel" if "vs_kt_kernel" in p else "")
            + ")"
            for T, p in r["prefill"].items()
        )
        err = f"{r['rel_error']:.4f}" if "rel_error" in r else "-"
        print(f"| {r['layer']} | {r['method']} | {r['threads']} | {dec} | {pre} | {err} |")
