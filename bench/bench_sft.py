"""Fine-tuning mode benchmark: one MoE layer's forward + backward with LoRA on the CPU experts.

    python bench/bench_sft.py                                  # Qwen3-30B-A3B layer, 512 tokens, rank 16
    python bench/bench_sft.py --methods BF16 AMXINT8 --tokens 128 512 --torch-dtypes fp32

Per method, medians over repeats, all in one process on the same threads:
- ``inference_forward_s``: the inference layer's forward (the method's own kernels);
- ``sft_forward_s``, ``sft_backward_s``: the fine-tuning layer's forward (keeping what the backward
  needs) and backward (input, routing-weight and adapter gradients);
- ``torch_bf16_step_s``, ``torch_fp32_step_s``: the same step in plain torch, autograd (the
  per-expert loop of transformers' MoE blocks), with bf16 weights and adapters and with float32 ones
  (on CPUs without bf16 arithmetic, AVX2 ones, torch's bf16 is emulated and float32 is its fast path).
Targets (issue 27): (forward + backward) / inference forward <= 3.5; the faster torch step / ours >= 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kt_sglang.engine import KTMoEWrapper
from kt_sglang.engine.native import _native
from kt_sglang.engine.sft import LORA_TENSORS

LAYERS = {"qwen3-30b-a3b": dict(E=128, k=8, H=2048, I=768)}


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch of buffers, thread start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_step(hidden, ids, weights, gate, up, down, lora, scale, grad_out):
    """The plain torch step: per expert, bf16 F.linear with LoRA, autograd."""
    x = hidden.detach().requires_grad_()
    w = weights.detach().requires_grad_()
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        F = torch.nn.functional
        g = F.linear(xe, gate[e]) + scale * F.linear(F.linear(xe, lora[0][e]), lora[1][e])
        u = F.linear(xe, up[e]) + scale * F.linear(F.linear(xe, lora[2][e]), lora[3][e])
        h = F.silu(g) * u
        y = F.linear(h, down[e]) + scale * F.linear(F.linear(h, lora[4][e]), lora[5][e])
        out = out.index_add(0, tok, y * w[tok, slot][:, None].to(y.dtype))
    out.backward(grad_out)


def make_inputs(layer: dict, T: int):
    """Routing, hidden states and the output's gradient of one step (the same for every method)."""
    E, k, H = layer["E"], layer["k"], layer["H"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1)
    hidden = (torch.randn(T, H, generator=gen)).bfloat16()
    grad_out = (torch.randn(T, H, generator=gen) * 1e-2).bfloat16()
    return hidden, ids, weights, grad_out


def bench_torch(dtype: torch.dtype, layer: dict, T: int, rank: int, repeats: int, dense) -> float:
    """The plain torch step's median time, weights and adapters in `dtype`."""
    E, H, I = layer["E"], layer["H"], layer["I"]
    hidden, ids, weights, grad_out = make_inputs(layer, T)
    shapes = [(E, rank, H), (E, I, rank), (E, rank, H), (E, I, rank), (E, rank, I), (E, H, rank)]
    lora = [torch.nn.Parameter((torch.randn(s) * 0.01).to(dtype)) for s in shapes]
    frozen = tuple(w.to(dtype) for w in dense)
    x, g = hidden.to(dtype), grad_out.to(dtype)
    return median_time(lambda: torch_step(x, ids, weights, *frozen, lora, 32.0 / rank, g), repeats)


def bench_method(method: str, layer: dict, T: int, rank: int, threads: int, repeats: int, dense) -> dict:
    E, k, H, I = layer["E"], layer["k"], layer["H"], layer["I"]
    hidden, ids, weights, grad_out = make_inputs(layer, T)
    gen = torch.Generator().manual_seed(2)

    inference = KTMoEWrapper(0, E, k, H, I, None, threads, 1, method=method)
    inference.load_weights_from_tensors(*dense)
    t_inf = median_time(lambda: inference.forward(hidden, ids, weights), repeats)

    sft = KTMoEWrapper(0, E, k, H, I, None, threads, 1, method=method, mode="sft", lora_rank=rank)
    sft.load_weights_from_tensors(*dense)
    shapes = sft.lora_shapes()
    lora = [torch.randn(shapes[n], generator=gen) * 0.01 for n, _, _ in LORA_TENSORS]
    grads = [torch.zeros_like(t) for t in lora]
    sft.init_lora_weights(*lora, *grads)
    t_fwd = median_time(lambda: sft.forward(hidden, ids, weights, save_for_backward=False), repeats)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        sft.forward(hidden, ids, weights)
        t1 = time.perf_counter()
        sft.backward(grad_out)
        return t1 - t0, time.perf_counter() - t1

    step()
    fb = [step() for _ in range(repeats)]
    t_sft_fwd = statistics.median(f for f, _ in fb)
    t_sft_bwd = statistics.median(b for _, b in fb)
    return {
        "method": method,
        "tokens": T,
        "rank": rank,
        "threads": threads,
        "inference_forward_s": t_inf,
        "sft_forward_nosave_s": t_fwd,
        "sft_forward_s": t_sft_fwd,
        "sft_backward_s": t_sft_bwd,
        "step_over_inference_forward": (t_sft_fwd + t_sft_bwd) / t_inf,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", choices=sorted(LAYERS), default="qwen3-30b-a3b")
    p.add_argument("--methods", nargs="+", default=["BF16", "AMXINT8", "AMXINT4"])
    p.add_argument("--tokens", type=int, nargs="+", default=[512])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--torch-dtypes",
        nargs="*",
        choices=["bf16", "fp32"],
        default=["bf16", "fp32"],
        help="the plain torch step's dtypes (none: no baseline; bf16 takes minutes without bf16 hardware)",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/sft-<time>.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    layer = LAYERS[args.layer]
    E, H, I = layer["E"], layer["H"], layer["I"]
    gen = torch.Generator().manual_seed(0)
    dense = tuple(
        (torch.randn(shape, generator=gen) / shape[2] ** 0.5).bfloat16()
        for shape in ((E, I, H), (E, I, H), (E, H, I))
    )
    rows = []
    torch_dtypes = {name: {"bf16": torch.bfloat16, "fp32": torch.float32}[name] for name in args.torch_dtypes}
    for T in args.tokens:
        torch_s = {
            name: bench_torch(dtype, layer, T, args.rank, args.repeats, dense)
            for name, dtype in torch_dtypes.items()
        }
        for method in args.methods:
            row = bench_method(method, layer, T, args.rank, args.threads, args.repeats, dense)
            row["layer"] = args.layer
            for name, seconds in torch_s.items():
                row[f"torch_{name}_step_s"] = seconds
            if torch_s:  # against the faster torch step
                row["torch_over_ours"] = min(torch_s.values()) / (
                    row["sft_forward_s"] + row["sft_backward_s"]
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = args.out or Path(__file__).parent / "results" / f"sft-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpu": _native.cpu_features()["brand"],
        "isa": _native.selected_isa(),
        "torch": torch.__version__,
    }
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
