"""The hybrid layer on a CUDA device: Triton split and hot experts, the CPU engine's submit and sync
ordered on a non-default stream (stream memory operations, and host functions as the fallback), a
CUDA graph of a whole step with deferral replayed at the captured size and a smaller one, and the
overlap of the two parts. Skipped without a GPU."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_hidden, make_routing
from test_layer_hybrid import HOT_SETS, E, H, K, assert_layers_match_reference, build_stack

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.native import _native
from kt_sglang.engine.reference import moe_reference, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def to_cuda(layers):
    for layer in layers:
        layer.gpu_slot_of = layer.gpu_slot_of.cuda()
        layer.w13, layer.w2 = layer.w13.cuda(), layer.w2.cuda()
    return layers


def run_step(layers, x, routes, num_tokens=None):
    h = x
    for layer, (ids, weights) in zip(layers, routes, strict=True):
        h = layer(h, ids, weights, num_tokens)
    return h


def step_inputs(tokens: int, seed: int = 0):
    x = make_hidden(tokens, H, seed=seed)
    routes = [make_routing(tokens, E, K, seed=seed + 60 + n, skip_fraction=0.05) for n in range(3)]
    return x, routes


def cuda_inputs(x, routes):
    return x.cuda(), [(ids.cuda(), w.cuda()) for ids, w in routes]


def test_host_launch_uses_the_driver():
    assert _native.cuda_host_launch_available(), _native.cuda_host_launch_status()


def test_stream_hand_over_uses_memory_operations():
    """The driver's stream memory operations, probed on the device eagerly and under graph capture."""
    from kt_sglang.engine.stream_signal import stream_signal

    forced = os.environ.get("KT_SGLANG_STREAM_SIGNAL") == "host"  # the fallback's own run asks for it
    assert stream_signal() == ("host-functions" if forced else "memops"), _native.stream_signal_status()


def test_host_function_fallback(tmp_path):
    """The stack and the graph tests again with host functions (KT_SGLANG_STREAM_SIGNAL=host)."""
    test = Path(__file__).resolve()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test), "-k",
         "side_stream_matches or graph_of_a_step"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "KT_SGLANG_STREAM_SIGNAL": "host"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-1000:]


@pytest.mark.parametrize("max_deferred", [0, 1, 3])
@pytest.mark.parametrize("hot_name", sorted(HOT_SETS))
def test_stack_on_a_side_stream_matches_reference(hot_name, max_deferred):
    """Three MoE layers on a non-default stream, each against the float32 MoE on its own input (the
    CPU-device stack is no reference: torch's bf16 `linear` rounds the hot experts' gate/up and down
    sums to bf16, the Triton kernels keep them in fp32; the stacks differed by 0.0108 all hot)."""
    layers, full = build_stack(HOT_SETS[hot_name], max_deferred)
    layers = to_cuda(layers)
    x, routes = step_inputs(21)
    h, cuda_routes = cuda_inputs(x, routes)
    inputs, outputs = [], []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for layer, (ids, weights) in zip(layers, cuda_routes, strict=True):
            inputs.append(h)
            h = layer(h, ids, weights)
            outputs.append(h)
    stream.synchronize()
    assert_layers_match_reference(
        HOT_SETS[hot_name], max_deferred, full, [t.cpu() for t in inputs], [t.cpu() for t in outputs], routes
    )


def test_cuda_graph_of_a_step_with_deferral_replays_at_smaller_sizes():
    captured = 8
    layers = to_cuda(build_stack(HOT_SETS["half-hot"], max_deferred=1)[0])
    KTMoEWrapper.set_capture_batch_sizes([captured])
    try:
        x, routes = cuda_inputs(*step_inputs(captured))
        num_tokens = torch.tensor([captured], dtype=torch.int32, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: Triton compiles, buffers exist before capture
                run_step(layers, x, routes, num_tokens)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_step(layers, x, routes, num_tokens)
        for tokens, seed in ((captured, 1), (5, 2), (1, 3)):
            new_x, new_routes = cuda_inputs(*step_inputs(tokens, seed))
            x[:tokens].copy_(new_x)
            for (ids, w), (new_ids, new_w) in zip(routes, new_routes, strict=True):
                ids[:tokens].copy_(new_ids)
                w[:tokens].copy_(new_w)
            num_tokens.fill_(tokens)
            graph.replay()
            torch.cuda.synchronize()
            eager = run_step(layers, new_x, new_routes)
            torch.cuda.synchronize()
            assert relative_error(out[:tokens].cpu(), eager.cpu()) <= 0.01, tokens
    finally:
        KTMoEWrapper.clear_buffer_cache()
        KTMoEWrapper.set_capture_batch_sizes([])


def median_ms(fn, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def test_cpu_and_gpu_parts_overlap():
    """With both parts busy the layer takes at most 15% more than the slower part alone (ratio of
    medians measured in the same run)."""
    layer = to_cuda(build_stack([set(range(E // 2))], max_deferred=0)[0])[0]
    tokens = 64
    x = make_hidden(tokens, H).cuda()
    ids, weights = make_routing(tokens, E, K)
    ids, weights = ids.cuda(), weights.cuda()
    from kt_sglang.kernels import split_routing

    split = split_routing(ids, weights, layer.gpu_slot_of, 0)
    stream = torch.cuda.current_stream()

    def cpu_only():
        layer.experts.submit_forward(x, split.cold_ids, weights, stream)
        layer.experts.sync_forward(x, stream)

    def gpu_only():
        layer.hot_forward(x, split.hot_ids, weights)

    for fn in (cpu_only, gpu_only, lambda: layer(x, ids, weights)):
        fn()  # warm up
    both = median_ms(lambda: layer(x, ids, weights))
    slower = max(median_ms(cpu_only), median_ms(gpu_only))
    assert both <= 1.15 * slower, f"layer {both:.3f} ms, slower part alone {slower:.3f} ms"


@pytest.mark.parametrize("method", ["AMXINT4", "AMXINT8", "BF16", "FP8", "MXFP4"])
def test_gpu_prefill_streams_packed_experts(method, monkeypatch):
    """Long chunks' cold experts copied to the GPU in the packed layout and computed there from those
    bytes by the packed kernels (never decoded to memory): against the float32 MoE of the method's
    values, whole layers and rounds of two experts, on a side stream."""
    import test_gpu_prefill as gp

    from kt_sglang.engine.methods import Method
    from kt_sglang.layer import GpuPrefill, HybridMoELayer

    def decoded(*args, **kwargs):
        raise AssertionError("the streamed experts were decoded: the packed kernels should compute them")

    monkeypatch.setattr("kt_sglang.layer.prefill.decode_experts", decoded)

    layers, full = gp.build_model(Method(method), [set(), {1, 5}, set()])
    layers = to_cuda(layers)
    per_expert = None
    for cap in (None, "two experts a half"):
        if cap is not None:
            per_expert = layers[0].prefill_source.expert_bytes()
        prefill = GpuPrefill(gp.THRESHOLD, "cuda", None if per_expert is None else 4 * per_expert)
        HybridMoELayer.enable_gpu_prefill(layers, prefill)
        stream = torch.cuda.Stream()
        for tokens in (gp.THRESHOLD, 200):
            with torch.cuda.stream(stream):
                outs = []
                for n, layer in enumerate(layers):
                    x = make_hidden(tokens, gp.H, seed=tokens + n)
                    ids, weights = make_routing(tokens, gp.E, gp.K, seed=tokens + 10 + n, skip_fraction=0.05)
                    y = layer(x.cuda(), ids.cuda(), weights.cuda())
                    outs.append((y, moe_reference(x, *full[n], ids, weights)))
            stream.synchronize()
            for n, (y, want) in enumerate(outs):
                err = relative_error(y.cpu(), want)
                assert err <= 0.01, f"{method} {tokens} tokens, cap {cap}, layer {n}: {err:.4f}"
        assert prefill.stats.layer_forwards == 2 * len(layers)
