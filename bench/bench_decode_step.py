"""A decode step of a model's layers, the routed experts split between the GPU and the CPU engine.

    python bench/bench_decode_step.py [--model qwen3-30b-a3b|deepseek-v3|tiny] [--layers 3]
        [--batches 1 4 16 64 128] [--hot 0 0.1 0.25] [--deferral 0 1 2 4] [--context 2048]
        [--method AMXINT4] [--device cpu|cuda] [--no-graph] [--repeats 9] [--out FILE]
        [--trace zipf [--trace-steps 600] [--trace-phase 200] [--trace-skew 1.0]]

Each layer does what a model's decoder layer does on the GPU besides the routed experts: RMSNorm,
attention projections and a read of a KV cache of ``--context`` positions per sequence (grouped-query
attention for Qwen3; DeepSeek-V3's latent attention with the up-projections absorbed), RMSNorm, the
router (softmax top-k), the shared expert where the model has one, and the residual adds. The routed
experts go through `HybridMoELayer`: the ``--hot`` share of experts on the GPU, the rest on the engine,
the ``--deferral`` lowest-weight cold experts of each token deferred to the next layer. On CUDA the
whole step is captured in one CUDA graph per configuration, as SGLang's decode runner does.
DeepSeek-V3 keeps its layer's shapes with 64 of its 256 routed experts (a layer fits in a
benchmark host's memory; at batch 1-16 a token touches as many experts either way).

Per configuration: the step's median time, tokens/s, and the speedup of each deferral against none
(every batch defers here, whatever the layer's default limit); per hot share, the largest batch up
to which deferral pays (`--kt-deferral-max-batch`);
per batch and hot share, the GPU part alone (the step without the engine), the CPU part alone (the
engine's cold experts of the same routing) and their overlap,
(gpu + cpu - step) / min(gpu, cpu): 1 when the shorter part hides entirely, 0 when they take turns,
and the synchronization cost per layer, (step - gpu - cpu) / layers: what the step costs beyond its
parts run one after the other (at 0% hot, where the parts cannot overlap, the cost of handing each
layer's work between the GPU stream and the engine).
On the CPU device both parts share the cores and run in turn; CI runs it there as a smoke test.

With ``--trace zipf`` it compares placements instead: the routed experts follow a synthetic trace,
Zipf-like per layer with a share of the ranks reshuffled every ``--trace-phase`` steps
(kt_sglang/placement/trace.py; the router still runs, its choice is replaced), and each hot share
runs the trace with uniform placement (experts 0..n-1), placement by heat (n slots: n - max_moves
hot and max_moves spare, starting from uniform) and the best static choice in hindsight (per layer
the n experts routed to most over the whole trace), without deferral. Per batch, hot share and
placement: the share of routed selections served by GPU slots, the median step (with the
placement's work between steps) and the moves per step. On the CPU device only the shares mean
anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.pools import physical_cores, reserved_cores, serving_threads
from kt_sglang.kernels import split_routing
from kt_sglang.layer import DeferralChain, HybridMoELayer
from kt_sglang.placement import HeatConfig, HeatPlacement, place_by_heat, slot_map
from kt_sglang.placement.trace import ZipfTrace, best_static, served


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int  # routed expert
    experts: int
    top_k: int
    heads: int
    head_dim: int
    kv_heads: int = 0  # grouped-query attention
    latent: int = 0  # latent attention (DeepSeek): cached latent width, rope part, query rank
    rope: int = 0
    q_rank: int = 0
    shared_inter: int = 0  # shared expert, 0 = none


SHAPES = {
    "qwen3-30b-a3b": Shape(hidden=2048, inter=768, experts=128, top_k=8, heads=32, head_dim=128, kv_heads=4),
    "deepseek-v3": Shape(
        hidden=7168,
        inter=2048,
        experts=64,
        top_k=8,
        heads=128,
        head_dim=128,
        latent=512,
        rope=64,
        q_rank=1536,
        shared_inter=2048,
    ),  # fmt: skip
    "tiny": Shape(
        hidden=256, inter=128, experts=16, top_k=4, heads=4, head_dim=64, kv_heads=2, shared_inter=128
    ),
}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight


class DenseParts(torch.nn.Module):
    """A decoder layer's GPU work besides the routed experts, with its KV cache for ``batch`` sequences."""

    def __init__(self, s: Shape, batch: int, context: int, device: str, gen: torch.Generator) -> None:
        super().__init__()
        dt = torch.bfloat16

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dt).to(device)

        H = s.hidden
        self.s = s
        self.norm1 = torch.ones(H, dtype=dt, device=device)
        self.norm2 = torch.ones(H, dtype=dt, device=device)
        self.router = w(s.experts, H)
        if s.latent:
            nope = s.head_dim
            self.q_a, self.q_b = w(s.q_rank, H), w(s.heads * (nope + s.rope), s.q_rank)
            self.kv_a = w(s.latent + s.rope, H)
            self.k_up = w(s.heads, nope, s.latent)  # absorbed into the query
            self.v_up = w(s.heads, s.latent, s.head_dim)  # applied to the latent output
            self.cache = w(batch, context, s.latent + s.rope)
        else:
            self.q = w(s.heads * s.head_dim, H)
            self.kv = w(2 * s.kv_heads * s.head_dim, H)
            self.k_cache = w(batch, s.kv_heads, context, s.head_dim)
            self.v_cache = w(batch, s.kv_heads, context, s.head_dim)
        self.o = w(H, s.heads * s.head_dim)
        if s.shared_inter:
            self.shared_gate_up = w(2 * s.shared_inter, H)
            self.shared_down = w(H, s.shared_inter)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        s, B = self.s, x.shape[0]
        h = _rms_norm(x, self.norm1)
        if s.latent:
            q = F.linear(F.linear(h, self.q_a), self.q_b).view(B, s.heads, s.head_dim + s.rope)
            self.cache[:B, -1] = F.linear(h, self.kv_a)  # this step's latent, at the last position
            q_latent = torch.einsum("bhd,hdl->bhl", q[..., : s.head_dim], self.k_up)
            q_full = torch.cat([q_latent, q[..., s.head_dim :]], -1)  # [B, heads, latent + rope]
            cache = self.cache[:B]
            scores = torch.einsum("bhl,bcl->bhc", q_full, cache).float() / (s.head_dim + s.rope) ** 0.5
            out_latent = torch.einsum("bhc,bcl->bhl", scores.softmax(-1).to(x.dtype), cache[..., : s.latent])
            out = torch.einsum("bhl,hld->bhd", out_latent, self.v_up).reshape(B, -1)
        else:
            q = F.linear(h, self.q).view(B, s.heads, 1, s.head_dim)
            k, v = F.linear(h, self.kv).view(B, 2, s.kv_heads, 1, s.head_dim).unbind(1)
            self.k_cache[:B, :, -1:] = k
            self.v_cache[:B, :, -1:] = v
            out = F.scaled_dot_product_attention(q, self.k_cache[:B], self.v_cache[:B], enable_gqa=True)
            out = out.reshape(B, -1)
        return x + F.linear(out, self.o)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(h, self.router).float().softmax(-1)
        weights, ids = probs.topk(self.s.top_k, -1)
        return ids, weights / weights.sum(-1, keepdim=True)

    def shared(self, h: torch.Tensor) -> torch.Tensor | None:
        if not self.s.shared_inter:
            return None
        gate, up = F.linear(h, self.shared_gate_up).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.shared_down)


class DecoderStack(torch.nn.Module):
    """``part``: "both" (the step), "gpu" (the engine's cold experts skipped) or "record" (the step,
    keeping each layer's MoE input and routing for the CPU part alone)."""

    def __init__(self, dense: list[DenseParts], moe: list[HybridMoELayer]) -> None:
        super().__init__()
        self.dense, self.moe = dense, moe
        self.part = "both"
        self.recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # with a routing trace: each layer's ids for the step, written before each step (or replay)
        self.trace_ids: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recorded = []
        for n, (dense, moe) in enumerate(zip(self.dense, self.moe, strict=True)):
            x = dense.attention(x)
            h = _rms_norm(x, dense.norm2)
            ids, weights = dense.route(h)
            if self.trace_ids is not None:
                ids = self.trace_ids[n]
            if self.part == "gpu":
                split = split_routing(ids, weights, moe.gpu_slot_of, 0)
                y = moe.hot_forward(h, split.hot_ids, weights).to(h.dtype)
            else:
                y = moe(h, ids, weights)
                if self.part == "record":
                    self.recorded.append((h, ids, weights))
            shared = dense.shared(h)
            x = x + (y if shared is None else y + shared)
        return x


def build_moe(
    sources, hot: float, deferral: int, device: str, hot_sets: list[list[int]] | None = None, spare: int = 0
) -> list[HybridMoELayer]:
    """Experts 0..n-1 hot in every layer (or ``hot_sets``), plus ``spare`` slots (experts n..)."""
    chain = DeferralChain()
    layers = []
    for n, (gate, up, down, experts) in enumerate(sources):
        E = gate.shape[0]
        n_hot = round(E * hot) - spare
        hot_ids = hot_sets[n] if hot_sets is not None else list(range(n_hot))
        rows = sorted(hot_ids) + [e for e in range(E) if e not in hot_ids][:spare]  # slot_map's order
        w13 = torch.cat([gate[rows], up[rows]], 1).to(device)
        layer = HybridMoELayer(
            experts,
            slot_map(hot_ids, E).to(device),
            w13,
            down[rows].to(device),
            chain,
            deferral,
            deferral_max_tokens=None,
        )  # every batch defers: this measures where deferral pays
        layers.append(layer)
    HybridMoELayer.link(layers)
    return layers


def deferral_pays_up_to(rows: list[dict], hot: float, margin: float = 1.02) -> int:
    """The largest batch up to which, batch by batch, some deferral beats none by ``margin``
    (0: not even the smallest); `--kt-deferral-max-batch` for this hot share."""
    best = {}
    for r in rows:
        if r["hot_fraction"] == hot and r["deferral"] > 0:
            best[r["batch"]] = max(best.get(r["batch"], 0.0), r["speedup"])
    limit = 0
    for batch in sorted(best):
        if best[batch] < margin:
            break
        limit = batch
    return limit


def timed(fn, repeats: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` after two warm-up calls."""
    times = []
    for i in range(repeats + 2):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_fn(stack: DecoderStack, x: torch.Tensor, graph: bool):
    """The step as a callable: eager, or one CUDA graph replay (captured here)."""
    if not graph:
        return lambda: stack(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            stack(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        stack(x)
    return g.replay


def cpu_part_time(stack: DecoderStack, x: torch.Tensor, repeats: int) -> float:
    """The engine's cold experts of the step's routing, layer after layer, with nothing else running."""
    stack.part = "record"
    stack(x)
    stack.part = "both"
    calls = []
    for (h, ids, weights), moe in zip(stack.recorded, stack.moe, strict=True):
        split = split_routing(ids, weights, moe.gpu_slot_of, 0)
        calls.append((moe.experts, h.cpu(), split.cold_ids.cpu(), weights.cpu()))
    return timed(lambda: [experts.forward(h, ids, w) for experts, h, ids, w in calls], repeats, False)


def run_trace(
    stack: DecoderStack,
    x: torch.Tensor,
    trace: list[list[torch.Tensor]],
    graph: bool,
    cuda: bool,
    placement: HeatPlacement | None,
) -> dict:
    """The steps of ``trace`` through ``stack``: served share, median step, moves per step."""
    stack.trace_ids = [ids.to(x.device) for ids in trace[0]]
    fn = step_fn(stack, x, graph)
    static = [(moe.gpu_slot_of >= 0).cpu() for moe in stack.moe]
    moves_before = placement.moves if placement else 0
    hit = total = 0
    times = []
    for step in trace:
        for buf, ids in zip(stack.trace_ids, step, strict=True):
            buf.copy_(ids, non_blocking=True)
        # the tables this step reads (a commit writes the device's in stream order)
        masks = [slots.table >= 0 for _, slots in placement.layers] if placement else static
        for mask, ids in zip(masks, step, strict=True):
            h, t = served(ids, mask)
            hit, total = hit + h, total + t
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if placement:
            placement.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    stack.trace_ids = None
    moves = (placement.moves - moves_before) if placement else 0
    return {
        "served_share": hit / total,
        "step_ms": statistics.median(times) * 1e3,
        "moves_per_step": moves / len(trace),
    }


def compare_placements(args, s: Shape, sources, gen: torch.Generator, cuda: bool, graph: bool) -> list[dict]:
    """Uniform, heat and best-static-in-hindsight placement on one drifting trace per batch."""
    config = HeatConfig(max_moves=args.heat_max_moves, interval_steps=args.heat_interval)
    pin = cuda
    host = [
        (torch.cat([g, u], 1).pin_memory() if pin else torch.cat([g, u], 1), d.pin_memory() if pin else d)
        for g, u, d, _ in sources
    ]
    rows = []
    for batch in args.batches:
        KTMoEWrapper.set_capture_batch_sizes([batch])
        dense = [DenseParts(s, batch, args.context, args.device, gen) for _ in range(args.layers)]
        x = (torch.randn(batch, s.hidden, generator=gen) / 4).bfloat16().to(args.device)
        trace = ZipfTrace(
            s.experts, s.top_k, args.layers, args.trace_skew, args.trace_phase, seed=batch
        ).steps(args.trace_steps, batch)
        for hot in args.hot:
            slots = round(s.experts * hot)
            spare = min(config.max_moves, slots - 1)
            if spare < 1:
                continue  # heat needs a hot slot and a spare one
            runs = {
                "uniform": (build_moe(sources, hot, 0, args.device), None),
                "best-static": (
                    build_moe(sources, hot, 0, args.device, best_static(trace, s.experts, slots)),
                    None,
                ),
            }
            moe = build_moe(sources, hot, 0, args.device, spare=spare)
            runs["heat"] = (moe, place_by_heat(moe, host, replace(config, max_moves=spare)))
            for name, (moe, placement) in runs.items():
                r = run_trace(DecoderStack(dense, moe), x, trace, graph, cuda, placement)
                rows.append({
                    "batch": batch, "hot_fraction": hot, "placement": name, "slots": slots,
                    "hot_experts": slots - (spare if placement else 0), **r,
                })  # fmt: skip
        del dense
        KTMoEWrapper.set_capture_batch_sizes([])
        KTMoEWrapper.clear_buffer_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--hot", type=float, nargs="+", default=[0.0, 0.1, 0.25])
    p.add_argument("--deferral", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--context", type=int, default=2048, help="KV-cache positions per sequence")
    p.add_argument("--method", default="AMXINT4")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--no-graph", action="store_true", help="on CUDA, time eager steps (no CUDA graph)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", type=Path)
    p.add_argument("--trace", choices=("zipf",), help="compare placements on a drifting routing trace")
    p.add_argument("--trace-steps", type=int, default=600)
    p.add_argument("--trace-phase", type=int, default=200, help="steps between two drifts of the hot set")
    p.add_argument("--trace-skew", type=float, default=1.0, help="Zipf exponent of the routing")
    p.add_argument("--heat-max-moves", type=int, default=HeatConfig.max_moves)
    p.add_argument("--heat-interval", type=int, default=HeatConfig.interval_steps)
    args = p.parse_args()
    if 0 not in args.deferral:
        p.error("--deferral must include 0 (the speedups are against it)")
    s = SHAPES[args.model]
    args.deferral = sorted(d for d in set(args.deferral) if d < s.top_k)  # at most top_k - 1 deferred
    cuda = args.device == "cuda"
    graph = cuda and not args.no_graph
    # The serving rule (kt_sglang.engine.pools.reserved_cores): the engine leaves a quarter of the
    # cores to the threads that launch, wait and run torch's own work (the GPU part on the CPU device).
    torch.set_num_threads(reserved_cores())
    gen = torch.Generator().manual_seed(0)
    sources = []
    for n in range(args.layers):
        gate = (torch.randn(s.experts, s.inter, s.hidden, generator=gen) / s.hidden**0.5).bfloat16()
        up = (torch.randn(s.experts, s.inter, s.hidden, generator=gen) / s.hidden**0.5).bfloat16()
        down = (torch.randn(s.experts, s.hidden, s.inter, generator=gen) / s.inter**0.5).bfloat16()
        experts = KTMoEWrapper(
            n, s.experts, s.top_k, s.hidden, s.inter, None, serving_threads(), 1, method=args.method
        )
        experts.load_weights_from_tensors(gate, up, down)
        sources.append((gate, up, down, experts))
    if args.trace:
        trace_main(args, s, sources, gen, cuda, graph)
        return
    rows, parts = [], []
    for batch in args.batches:
        KTMoEWrapper.set_capture_batch_sizes([batch])  # buffers of their own, as SGLang's captured sizes
        dense = [DenseParts(s, batch, args.context, args.device, gen) for _ in range(args.layers)]
        x = (torch.randn(batch, s.hidden, generator=gen) / 4).bfloat16().to(args.device)
        for hot in args.hot:
            base = None
            for deferral in args.deferral:
                stack = DecoderStack(dense, build_moe(sources, hot, deferral, args.device))
                t = timed(step_fn(stack, x, graph), args.repeats, cuda)
                base = base or t
                rows.append({
                    "batch": batch, "hot_fraction": hot, "deferral": deferral, "step_ms": t * 1e3,
                    "tokens_per_s": batch / t, "speedup": base / t,
                })  # fmt: skip
                if deferral == 0:
                    step0 = t
                    gpu_stack = DecoderStack(dense, stack.moe)
                    gpu_stack.part = "gpu"
                    gpu = timed(step_fn(gpu_stack, x, graph), args.repeats, cuda)
                    cpu = cpu_part_time(stack, x, args.repeats)
                    parts.append({
                        "batch": batch, "hot_fraction": hot, "step_ms": step0 * 1e3, "gpu_ms": gpu * 1e3,
                        "cpu_ms": cpu * 1e3, "overlap": (gpu + cpu - step0) / min(gpu, cpu),
                        "sync_ms_per_layer": (step0 - gpu - cpu) / args.layers * 1e3,
                    })  # fmt: skip
        del dense
        KTMoEWrapper.set_capture_batch_sizes([])
        KTMoEWrapper.clear_buffer_cache()
    result = {
        **run_header(args, cuda, graph),
        "engine_threads": serving_threads(),
        "torch_threads": reserved_cores(),
        "rows": rows,
        "parts": parts,
        "deferral_pays_up_to": {str(hot): deferral_pays_up_to(rows, hot) for hot in args.hot},
    }
    print(
        f"{args.layers} {args.model} layers, context {args.context}, {args.method}, {physical_cores()} cores "
        f"(engine {serving_threads()}, torch {reserved_cores()}), {result['device']}"
        f"{', CUDA graph' if graph else ''}"
    )
    defs = args.deferral
    print(
        "| batch | hot | "
        + " | ".join(f"deferral {d}: ms (x)" for d in defs)
        + " | GPU part | CPU part | overlap | sync per layer |"
    )
    print("|---|---|" + "---|" * (len(defs) + 4))
    for part in parts:
        cells = [
            f"{r['step_ms']:.2f} ({r['speedup']:.2f})"
            for r in rows
            if r["batch"] == part["batch"] and r["hot_fraction"] == part["hot_fraction"]
        ]
        print(
            f"| {part['batch']} | {part['hot_fraction'] * 100:.0f}% | " + " | ".join(cells)
            + f" | {part['gpu_ms']:.2f} | {part['cpu_ms']:.2f} | {part['overlap']:.2f}"
            + f" | {part['sync_ms_per_layer']:.3f} |"
        )  # fmt: skip
    pays = ", ".join(f"{float(h) * 100:.0f}% hot: {b}" for h, b in result["deferral_pays_up_to"].items())
    print(f"deferral pays (x1.02 or more) up to batch: {pays}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


def run_header(args, cuda: bool, graph: bool) -> dict:
    """What every result file says of the run."""
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cuda_graph": graph,
        "model": args.model,
        "method": args.method,
        "layers": args.layers,
        "context": args.context,
    }


def trace_main(args, s: Shape, sources, gen: torch.Generator, cuda: bool, graph: bool) -> None:
    rows = compare_placements(args, s, sources, gen, cuda, graph)
    result = {
        **run_header(args, cuda, graph),
        "trace": {"kind": args.trace, "steps": args.trace_steps, "phase_steps": args.trace_phase,
                  "skew": args.trace_skew, "drift": ZipfTrace.drift},
        "heat": {"max_moves": args.heat_max_moves, "interval_steps": args.heat_interval},
        "placements": rows,
    }  # fmt: skip
    print(
        f"{args.layers} {args.model} layers, {args.trace} trace ({args.trace_steps} steps, drift every "
        f"{args.trace_phase}, skew {args.trace_skew}), {args.method}, {result['device']}"
        f"{', CUDA graph' if graph else ''}"
    )
    print("| batch | slots | placement | hot | served share | step ms | x uniform | moves/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        key = (r["batch"], r["hot_fraction"])
        base = next(
            u["step_ms"] for u in rows if (u["batch"], u["hot_fraction"], u["placement"]) == (*key, "uniform")
        )
        print(
            f"| {r['batch']} | {r['slots']} ({r['hot_fraction'] * 100:.0f}%) | {r['placement']} | "
            f"{r['hot_experts']} | {r['served_share']:.3f} | {r['step_ms']:.2f} | "
            f"{base / r['step_ms']:.2f} | {r['moves_per_step']:.3f} |"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
