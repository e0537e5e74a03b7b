"""Long prompts' cold experts streamed and computed beside the engine (kt_sglang/layer/prefill.py), on
the CPU device: the same pipeline as on a GPU (staging halves, rounds, layers staged ahead) with host
buffers and the torch twins."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_hidden, make_routing

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.canonical import dequantize, quantize, random_canonical
from kt_sglang.engine.methods import METHODS, Method
from kt_sglang.engine.reference import moe_reference, relative_error
from kt_sglang.layer import DeferralChain, GpuPrefill, HybridMoELayer
from kt_sglang.layer.prefill import crossover, measure_cpu_tokens_per_s

E, K, H, I = 8, 2, 128, 96
THRESHOLD = 16


def build_model(method: Method, hot_sets: list[set[int]], max_deferred: int = 1):
    """MoE layers of canonical experts; the engine holds the cold ones, hot ones sit in slots. Returns
    the layers and each layer's dequantized float32 (gate, up, down) for the reference."""
    chain = DeferralChain()
    layers, full = [], []
    for n, hot in enumerate(hot_sets):
        gen = torch.Generator().manual_seed(n)
        mats = []
        for N, Kdim in ((I, H), (I, H), (H, I)):
            if METHODS[method].quantizes_dense:
                mats.append(
                    [quantize(method, torch.randn(N, Kdim, generator=gen) / Kdim**0.5) for _ in range(E)]
                )
            else:
                mats.append([random_canonical(method, N, Kdim, seed=100 * n + e) for e in range(E)])
        mask = torch.tensor([e in hot for e in range(E)])
        experts = KTMoEWrapper(n, E, K, H, I, mask, 1, 1, method=method.value)
        experts.load_canonical(*mats)
        group, down_group = experts.group_size, experts.down_group_size
        gate = torch.stack([dequantize(method, m, H, group) for m in mats[0]])
        up = torch.stack([dequantize(method, m, H, group) for m in mats[1]])
        down = torch.stack([dequantize(method, m, I, down_group) for m in mats[2]])
        slot_of = torch.full((E,), -1)
        hot_ids = sorted(hot)
        slot_of[hot_ids] = torch.arange(len(hot_ids))
        w13 = torch.cat([gate, up], 1)[hot_ids].bfloat16()
        layers.append(HybridMoELayer(experts, slot_of, w13, down[hot_ids].bfloat16(), chain, max_deferred))
        full.append((gate, up, down))
    HybridMoELayer.link(layers)
    return layers, full


def run(layers, full, tokens: int, seed: int = 0):
    """Each layer on its own random input; returns (output, float32 reference) per layer."""
    results = []
    for n, layer in enumerate(layers):
        x = make_hidden(tokens, H, seed=seed + n)
        ids, weights = make_routing(tokens, E, K, seed=seed + 10 + n, skip_fraction=0.05)
        results.append((layer(x, ids, weights), moe_reference(x, *full[n], ids, weights)))
    return results


@pytest.mark.parametrize("method", list(Method), ids=lambda m: m.value)
def test_streamed_layers_match_the_float32_moe(method):
    """Every method at chunks around the threshold: from THRESHOLD tokens the cold experts are
    streamed and computed from their decoded packed bytes (only bf16 rounding of the weights and
    inputs: within 0.01 of the float32 MoE of the method's own values)."""
    layers, full = build_model(method, [set(), {1, 5}])
    prefill = GpuPrefill(THRESHOLD, "cpu")
    HybridMoELayer.enable_gpu_prefill(layers, prefill)
    for tokens in (THRESHOLD - 1, THRESHOLD, 3 * THRESHOLD):
        before = prefill.stats.layer_forwards
        for n, (y, want) in enumerate(run(layers, full, tokens, seed=tokens)):
            bound = 0.01 if tokens >= THRESHOLD else METHODS[method].error_bound + 0.01
            assert relative_error(y, want) <= bound, (
                f"{tokens} tokens, layer {n}: {relative_error(y, want):.4f}"
            )
        assert prefill.stats.layer_forwards - before == (len(layers) if tokens >= THRESHOLD else 0)


@pytest.mark.parametrize("hot_name", ["none", "some", "all"])
def test_only_cold_experts_travel_and_staged_layers_are_reused(hot_name):
    """Hot experts never travel; with a buffer of two layers a second chunk copies nothing (both
    layers are still staged); the output is the same both times."""
    hot = {"none": set(), "some": {0, 3, 4}, "all": set(range(E))}[hot_name]
    layers, full = build_model(Method.AMXINT8, [hot, hot])
    prefill = GpuPrefill(THRESHOLD, "cpu")
    HybridMoELayer.enable_gpu_prefill(layers, prefill)
    first = run(layers, full, 40)
    cold = E - len(hot)
    assert prefill.stats.experts_copied == 2 * cold
    assert prefill.stats.bytes_copied == 2 * cold * layers[0].prefill_source.expert_bytes()
    second = run(layers, full, 40)
    assert prefill.stats.experts_copied == 2 * cold  # nothing copied again
    for (a, want), (b, _) in zip(first, second, strict=True):
        assert torch.equal(a, b)
        assert relative_error(a, want) <= 0.01


@pytest.mark.parametrize("slots", [1, 3])
def test_a_buffer_smaller_than_a_layer_gives_the_same_output(slots):
    """A cap of a few experts a half: each layer passes through in rounds; same output as whole layers."""
    layers, full = build_model(Method.AMXINT4, [set(), {2}, set()])
    whole = GpuPrefill(THRESHOLD, "cpu")
    HybridMoELayer.enable_gpu_prefill(layers, whole)
    want = run(layers, full, 24)
    per_expert = layers[0].prefill_source.expert_bytes()
    capped = GpuPrefill(THRESHOLD, "cpu", buffer_bytes=2 * slots * per_expert + per_expert // 2)
    HybridMoELayer.enable_gpu_prefill(layers, capped)
    got = run(layers, full, 24)
    assert capped._slots == slots
    assert capped.stats.experts_copied >= E + (E - 1) + E  # every cold expert of every layer, in rounds
    for (a, _), (b, _) in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_a_short_chunk_moves_only_its_routed_experts():
    """Fewer selections than two per held expert: only the experts some token routes to travel."""
    layers, full = build_model(Method.AMXINT8, [set(), {2}])
    prefill = GpuPrefill(4, "cpu")
    HybridMoELayer.enable_gpu_prefill(layers, prefill)
    copied = []
    for n, layer in enumerate(layers):
        x = make_hidden(5, H, seed=n)
        ids, weights = make_routing(5, E, K, seed=20 + n)
        before = prefill.stats.experts_copied
        y = layer(x, ids, weights)
        copied.append(prefill.stats.experts_copied - before)
        routed_cold = {int(e) for e in ids.flatten() if e >= 0} - layer.hot_experts
        assert copied[-1] == len(routed_cold) < E
        assert relative_error(y, moe_reference(x, *full[n], ids, weights)) <= 0.01


def test_a_buffer_too_small_falls_back_to_the_engine(caplog):
    """A buffer that cannot hold two experts: one log line, the engine computes, output unchanged."""
    layers, full = build_model(Method.BF16, [set(), set()])
    prefill = GpuPrefill(THRESHOLD, "cpu", buffer_bytes=10)
    HybridMoELayer.enable_gpu_prefill(layers, prefill)
    with caplog.at_level(logging.WARNING, logger="kt_sglang.layer.prefill"):
        results = run(layers, full, 32)
        run(layers, full, 32)
    assert prefill.stats.layer_forwards == 0 and "holds no two experts" in prefill.disabled
    assert sum("GPU prefill off" in r.message for r in caplog.records) == 1
    for y, want in results:
        assert relative_error(y, want) <= 0.01


def test_a_pending_deferred_task_is_added_before_a_streamed_layer():
    """A decode step's deferred experts still pending when a long chunk arrives are drained and
    dropped (a new pass), never added to the prompt's output."""
    layers, full = build_model(Method.BF16, [set(), set()], max_deferred=1)
    HybridMoELayer.enable_gpu_prefill(layers, GpuPrefill(THRESHOLD, "cpu"))
    x = make_hidden(1, H, seed=3)
    ids, weights = make_routing(1, E, K, seed=4)
    layers[0](x, ids, weights)  # defers one expert to layers[1]
    assert layers[0].chain._producer is layers[0]
    (y, want), _ = run(layers, full, 20)
    assert layers[0].chain._producer is None
    assert relative_error(y, want) <= 0.01


def test_auto_threshold_is_the_crossover():
    """Copying a layer's cold experts takes bytes / bandwidth; the CPU engine takes tokens / rate:
    auto streams from the chunk size where the two meet. The engine's rate is measured on the layer."""
    layers, _ = build_model(Method.AMXINT4, [{0}])
    rate = measure_cpu_tokens_per_s(layers[0].experts, tokens=32)
    assert rate > 0
    found = crossover(h2d_gbps=50.0, cpu_tokens_per_s=80_000.0, layer_bytes=300 * 10**6)
    assert found.threshold == 480  # 6 ms of copies = 480 tokens at 80k tokens/s
    assert "GPU prefill threshold 480 tokens" in found.line() and "50.0 GB/s" in found.line()
    assert crossover(1e3, 1.0, 10).threshold == 1  # never below one token


def test_bad_threshold_is_refused():
    with pytest.raises(ValueError, match="threshold must be >= 1"):
        GpuPrefill(0, "cpu")
