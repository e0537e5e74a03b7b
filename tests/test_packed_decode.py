"""The engine's packed experts decoded in torch (kt_sglang/kernels/packed.py, what the GPU prefill
runs on the device) equal the canonical matrices they were packed from, for every method, with one
and two pools, shapes that need padding, and a layer whose hot experts the engine does not hold."""

from __future__ import annotations

import pytest
import torch

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.canonical import dequantize, quantize, random_canonical
from kt_sglang.engine.methods import METHODS, Method
from kt_sglang.kernels.packed import decode_experts
from kt_sglang.layer.prefill import PackedExperts

E, H, I = 5, 160, 96  # neither a multiple of 64: the packed layout pads both


def canonical_layer(method: Method, seed: int = 0):
    """One canonical matrix per expert and projection, as the engine's quantizer or a checkpoint
    would give them."""
    gen = torch.Generator().manual_seed(seed)

    def make(N: int, K: int, s: int):
        if METHODS[method].quantizes_dense:
            return quantize(method, torch.randn(N, K, generator=gen) / K**0.5)
        return random_canonical(method, N, K, seed=s)

    return [
        [make(N, K, seed * 100 + 3 * e + j) for e in range(E)]
        for j, (N, K) in enumerate(((I, H), (I, H), (H, I)))
    ]


@pytest.mark.parametrize("pools", [1, 2])
@pytest.mark.parametrize("method", list(Method), ids=lambda m: m.value)
def test_decoded_experts_equal_their_canonical_matrices(method, pools):
    gate, up, down = canonical_layer(method)
    hot = torch.zeros(E, dtype=torch.bool)
    hot[1] = True  # not held by the engine: not in its packed memory
    layer = KTMoEWrapper(0, E, 2, H, I, hot, pools, pools, method=method.value, numa_nodes=[0] * pools)
    layer.load_canonical(gate, up, down)
    packed = PackedExperts(layer)
    assert packed.held == [0, 2, 3, 4]
    rows = torch.tensor([packed.row_of[e] for e in packed.held])
    w13, w2 = decode_experts(
        packed.layout, [g[rows] for g in packed.gate_up], [d[rows] for d in packed.down], torch.float32
    )
    assert w13.shape == (4, 2 * I, H) and w2.shape == (4, H, I)
    group, down_group = layer.group_size, layer.down_group_size
    for n, e in enumerate(packed.held):
        want_gate = dequantize(method, gate[e], H, group)
        want_up = dequantize(method, up[e], H, group)
        want_down = dequantize(method, down[e], I, down_group)
        torch.testing.assert_close(w13[n, :I], want_gate, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(w13[n, I:], want_up, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(w2[n], want_down, rtol=1e-6, atol=1e-7)


def test_a_changed_packing_is_caught():
    """The byte counts the engine reports are checked against the layout the decoder assumes."""
    from dataclasses import replace

    gate, up, down = canonical_layer(Method.AMXINT4)
    layer = KTMoEWrapper(0, E, 2, H, I, None, 1, 1, method="AMXINT4")
    layer.load_canonical(gate, up, down)
    layout = PackedExperts(layer).layout
    with pytest.raises(ValueError, match="the engine reports"):
        replace(layout, group=32).check()
