"""The hybrid layer on the CPU device: split, combine and the deferral chain across a layer stack."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hidden, make_routing, make_weights

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.reference import moe_reference, relative_error
from kt_sglang.kernels import split_routing_torch
from kt_sglang.layer import DeferralChain, HybridMoELayer

E, K, H, I = 16, 4, 256, 128


def split_by_hand(ids, weights, hot: set[int], max_deferred: int):
    """Independent per-token split: which (token, slot) pairs are hot, cold now, deferred."""
    parts = {"hot": set(), "cold": set(), "deferred": set()}
    for t in range(ids.shape[0]):
        cold = [
            (float(weights[t, j]), j)
            for j in range(ids.shape[1])
            if ids[t, j] >= 0 and int(ids[t, j]) not in hot
        ]
        deferred = {j for _, j in sorted(cold)[:max_deferred]}
        for j in range(ids.shape[1]):
            if ids[t, j] < 0:
                continue
            key = "hot" if int(ids[t, j]) in hot else ("deferred" if j in deferred else "cold")
            parts[key].add((t, j))
    return parts


def masked_ids(ids, pairs):
    out = torch.full_like(ids, -1)
    for t, j in pairs:
        out[t, j] = ids[t, j]
    return out


@pytest.mark.parametrize("max_deferred", [0, 1, 3])
def test_split_matches_definition(max_deferred):
    ids, weights = make_routing(50, E, K, skip_fraction=0.1)
    weights[3] = 0.25  # ties: the earlier slot is deferred first
    hot = {1, 4, 9, 10}
    slot_of = torch.full((E,), -1)
    for s, e in enumerate(sorted(hot)):
        slot_of[e] = s
    before = ids.clone(), weights.clone()
    split = split_routing_torch(ids, weights, slot_of, max_deferred)
    assert torch.equal(ids, before[0]) and torch.equal(weights, before[1])  # router tensors untouched
    parts = split_by_hand(ids, weights, hot, max_deferred)
    assert torch.equal(split.cold_ids, masked_ids(ids, parts["cold"]))
    assert torch.equal(split.deferred_ids, masked_ids(ids, parts["deferred"]))
    expected_hot = masked_ids(ids, parts["hot"])
    assert torch.equal(split.hot_ids, torch.where(expected_hot >= 0, slot_of[expected_hot.clamp_min(0)], -1))


def build_stack(hot_sets, max_deferred, method="BF16", deferral_max_tokens=None):
    chain = DeferralChain()
    layers, full = [], []
    for n, hot in enumerate(hot_sets):
        gate, up, down = make_weights(E, I, H, seed=40 + n)
        experts = KTMoEWrapper(n, E, K, H, I, None, 2, 1, method=method)
        experts.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
        slot_of = torch.full((E,), -1)
        hot_ids = sorted(hot)
        for s, e in enumerate(hot_ids):
            slot_of[e] = s
        w13 = torch.cat([gate, up], 1)[hot_ids].bfloat16() if hot_ids else torch.zeros(0, 2 * I, H)
        w2 = down[hot_ids].bfloat16() if hot_ids else torch.zeros(0, H, I)
        layers.append(HybridMoELayer(experts, slot_of, w13, w2, chain, max_deferred, deferral_max_tokens))
        full.append((gate.bfloat16(), up.bfloat16(), down.bfloat16()))
    HybridMoELayer.link(layers)
    return layers, full


HOT_SETS = {
    "none-hot": [set(), set(), set()],
    "all-hot": [set(range(E))] * 3,
    "half-hot": [set(range(0, E, 2)), set(range(1, E, 2)), {0, 3, 5, 6, 7, 12, 13, 15}],
}


def assert_layers_match_reference(hot_sets, max_deferred, full, inputs, outputs, routes):
    """Each MoE layer's output against the float32 MoE on its own input: its hot and cold-now experts
    plus the previous MoE layer's deferred experts (on that layer's input); the last defers nothing."""
    prev_deferred = None
    for n, (x_in, y, (ids, weights)) in enumerate(zip(inputs, outputs, routes, strict=True)):
        last = n == len(outputs) - 1
        parts = split_by_hand(ids, weights, hot_sets[n], 0 if last else max_deferred)
        now = masked_ids(ids, parts["hot"] | parts["cold"])
        expected = moe_reference(x_in, *full[n], now, weights)
        if prev_deferred is not None:
            expected += prev_deferred
        prev_deferred = moe_reference(x_in, *full[n], masked_ids(ids, parts["deferred"]), weights)
        assert relative_error(y, expected) <= 0.01, f"layer {n}: {relative_error(y, expected):.4f}"


@pytest.mark.parametrize("max_deferred", [0, 1, 2, 3])
@pytest.mark.parametrize("hot_name", sorted(HOT_SETS))
def test_stack_with_dense_layer_matches_reference(hot_name, max_deferred):
    """moe0 -> dense -> moe1 -> moe2: layer L's output holds L's hot and cold-now experts plus the
    deferred experts of the previous MoE layer (on that layer's input); the last defers nothing."""
    hot_sets = HOT_SETS[hot_name]
    layers, full = build_stack(hot_sets, max_deferred)
    dense = torch.randn(H, H, generator=torch.Generator().manual_seed(9)) / H**0.5
    x = make_hidden(33, H)
    inputs, outputs, routes = [], [], []
    for n, layer in enumerate(layers):
        ids, weights = make_routing(33, E, K, seed=60 + n, skip_fraction=0.05)
        inputs.append(x)
        routes.append((ids, weights))
        y = layer(x, ids, weights)
        outputs.append(y)
        x = (y.float() @ dense.T).bfloat16() if n == 0 else y  # a dense layer between moe0 and moe1
    assert_layers_match_reference(hot_sets, max_deferred, full, inputs, outputs, routes)
    if max_deferred == 0:  # no deferral: each layer is the plain MoE of its input
        ids, weights = routes[0]
        assert relative_error(outputs[0], moe_reference(inputs[0], *full[0], ids, weights)) <= 0.01


def test_new_pass_drops_stale_deferred_output():
    layers, full = build_stack([set(), set()], max_deferred=2)
    x = make_hidden(8, H)
    ids, weights = make_routing(8, E, K, seed=70)
    layers[0](x, ids, weights)  # pass aborted after layer 0: its deferred task is pending
    again = layers[0](x, ids, weights)  # a new pass must not add the stale deferred output
    parts = split_by_hand(ids, weights, set(), 2)
    expected = moe_reference(x, *full[0], masked_ids(ids, parts["cold"]), weights)
    assert relative_error(again, expected) <= 0.01


def test_chains_of_two_models_are_independent():
    a, _ = build_stack([set(), set()], max_deferred=1)
    b, _ = build_stack([set(), set()], max_deferred=1)
    assert a[0].chain is not b[0].chain and a[0].next_moe is a[1] and b[1].next_moe is None


def test_layer_validation():
    experts = KTMoEWrapper(0, E, K, H, I, None, 1, 1, method="BF16")
    with pytest.raises(ValueError, match=r"gpu_slot_of has shape \(8,\)"):
        HybridMoELayer(
            experts, torch.full((8,), -1), torch.zeros(0, 2 * I, H), torch.zeros(0, H, I), DeferralChain()
        )
    with pytest.raises(ValueError, match=r"max_deferred_experts_per_token must be in \[0, 3\]"):
        HybridMoELayer(
            experts, torch.full((E,), -1), torch.zeros(0, 2 * I, H), torch.zeros(0, H, I), DeferralChain(), 4
        )


def test_hot_cold_and_deferred_parts_are_added_in_fp32_and_rounded_once():
    """Layer 1's output is round(hot + cold now + layer 0's deferred), each part fp32."""
    hot_sets = [set(range(0, E, 2)), set(range(1, E, 2))]
    layers, full = build_stack(hot_sets, max_deferred=1)
    x = make_hidden(12, H)
    routes = [make_routing(12, E, K, seed=80 + n) for n in range(2)]
    layers[0](x, *routes[0])
    y = layers[1](x, *routes[1])
    ids1, w1 = routes[1]
    split = split_routing_torch(ids1, w1, layers[1].gpu_slot_of, 0)
    hot = layers[1].hot_forward(x, split.hot_ids, w1)
    cold = layers[1].experts.forward(x, split.cold_ids, w1)
    ids0, w0 = routes[0]
    deferred_ids = split_routing_torch(ids0, w0, layers[0].gpu_slot_of, 1).deferred_ids
    deferred = layers[0].experts.forward(x, deferred_ids, w0)
    assert hot.dtype == cold.dtype == deferred.dtype == torch.float32
    assert torch.equal(y, (hot + cold + deferred).bfloat16())


def test_batches_above_the_deferral_limit_defer_nothing():
    """deferral_max_tokens=4: four tokens defer (layer 1 adds layer 0's deferred experts), five do
    not (each layer is the plain MoE of its input); the default limit is one token."""
    for tokens, defers in ((4, True), (5, False)):
        layers, full = build_stack([set(), set()], max_deferred=2, deferral_max_tokens=4)
        x = make_hidden(tokens, H)
        routes = [make_routing(tokens, E, K, seed=90 + n) for n in range(2)]
        outputs = [layers[0](x, *routes[0])]
        outputs.append(layers[1](outputs[0], *routes[1]))
        assert_layers_match_reference(
            [set(), set()], 2 if defers else 0, full, [x, outputs[0]], outputs, routes
        )
        assert (layers[0].chain._producer is None) and layers[0].deferral_max_tokens == 4
    experts = layers[0].experts
    layer = HybridMoELayer(
        experts, torch.full((E,), -1), torch.zeros(0, 2 * I, H), torch.zeros(0, H, I), DeferralChain()
    )
    assert layer.deferral_max_tokens == 1
    with pytest.raises(ValueError, match="deferral_max_tokens must be None or >= 0"):
        HybridMoELayer(
            experts,
            torch.full((E,), -1),
            torch.zeros(0, 2 * I, H),
            torch.zeros(0, H, I),
            DeferralChain(),
            1,
            -1,
        )


def test_hot_experts_computed_by_the_callers_function():
    """forward(..., hot=f): the hot part is what f returns for the split's slots (a serving
    framework's own GPU kernels); the cold part is the engine's as before."""
    layers, full = build_stack([set(range(0, E, 2))], max_deferred=0)
    layer = layers[0]
    x = make_hidden(9, H)
    ids, weights = make_routing(9, E, K, seed=95)
    calls = []

    def hot(hidden, slot_ids, w):
        calls.append(slot_ids.clone())
        return 2 * layer.hot_forward(hidden, slot_ids, w)

    doubled = layer(x, ids, weights, hot=hot)
    split = split_routing_torch(ids, weights, layer.gpu_slot_of, 0)
    assert len(calls) == 1 and torch.equal(calls[0], split.hot_ids)
    expected = 2 * layer.hot_forward(x, split.hot_ids, weights) + layer.experts.forward(
        x, split.cold_ids, weights
    )
    assert torch.equal(doubled, expected.bfloat16())
