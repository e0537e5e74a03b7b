"""The engine's activation options and expert biases against the float32 reference: gpt-oss's
SwiGLU (clamp 7, alpha 1.702, (u + 1), biases on gate, up and down) and DeepSeek-V4's clamped SiLU,
with every method on every ISA path."""

from __future__ import annotations

import pytest
import torch
from conftest import isa_params, make_hidden, make_routing, make_weights

from kt_sglang import KTMoEWrapper
from kt_sglang.engine import Glu
from kt_sglang.engine.canonical import random_experts
from kt_sglang.engine.methods import METHODS, parse_method
from kt_sglang.engine.reference import moe_reference, relative_error

GPT_OSS = Glu("swiglu_oai", limit=7.0, alpha=1.702)
DEEPSEEK_V4 = Glu("silu", limit=10.0)
METHOD_NAMES = [m.value for m in METHODS]


def _biases(E, I, H, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(E, n, generator=gen) * s for n, s in ((I, 1.0), (I, 1.0), (H, 0.2)))


def _layer(method, isa, E, k, H, I, activation, mask=None, biases=None, scale=1.0):
    """A layer of `method` and the float32 weights it holds (dense methods: scaled N(0, 1/fan_in) weights,
    whose gate/up outputs reach the clamp when scale > 1)."""
    layer = KTMoEWrapper(0, E, k, H, I, mask, 2, 1, method=method, isa=isa, activation=activation)
    if METHODS[parse_method(method)].quantizes_dense:
        gate, up, down = make_weights(E, I, H)
        gate, up = gate * scale, up * scale
        layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
        weights = (gate.bfloat16(), up.bfloat16(), down.bfloat16())
    else:
        mats, weights = random_experts(method, E, I, H)
        layer.load_canonical(*mats)
    if biases is not None:
        layer.load_biases(*biases)
    return layer, weights


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize("activation", [GPT_OSS, DEEPSEEK_V4], ids=["gpt-oss", "deepseek-v4"])
def test_activation_and_biases_match_reference(method, isa, activation):
    E, k, H, I, T = 16, 4, 384, 320, 40
    biases = _biases(E, I, H) if activation is GPT_OSS else None
    mask = torch.zeros(E, dtype=torch.bool)
    mask[3] = True
    # Gate/up outputs of several units: the clamps of both forms cut a part of them.
    layer, (gate, up, down) = _layer(method, isa, E, k, H, I, activation, mask, biases, scale=4.0)
    x = make_hidden(T, H)
    ids, wts = make_routing(T, E, k, skip_fraction=0.1)
    ref = moe_reference(x, gate, up, down, ids, wts, mask, activation, biases or (None, None, None))
    g = x.float() @ gate[0].float().T
    if method == "BF16":  # the clamps are exercised (for the dense methods' scaled weights)
        assert (g.abs() > activation.limit).float().mean() > 0.01
    bound = METHODS[parse_method(method)].error_bound
    assert relative_error(layer.forward(x, ids, wts), ref) <= max(bound, 0.01)


@pytest.mark.parametrize("I", [640, 64], ids=["two-slices", "first-slice-empty"])
@pytest.mark.parametrize("T", [24, 300], ids=["rows", "tokens"])
def test_biases_follow_the_slot_map_and_pools(I, T):
    """Two pools split the intermediate channels (with I = 64 the first pool's slice is empty), and
    slots map to other source experts: each bias must reach its expert once (the down bias is added
    by one pool only), on both down paths (rows stored apart, or summed per token)."""
    E, k, H = 8, 2, 256
    gate, up, down = make_weights(E, I, H)
    biases = _biases(E, I, H)
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(3)).tolist()
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 2, method="BF16", numa_nodes=[0, 0], activation=GPT_OSS)
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16(), perm)
    layer.load_biases(*biases, physical_to_logical_map=perm)
    x = make_hidden(T, H)
    ids, wts = make_routing(T, E, k)
    slot_weights = tuple(w[perm] for w in (gate.bfloat16(), up.bfloat16(), down.bfloat16()))
    slot_biases = tuple(b[perm] for b in biases)
    ref = moe_reference(x, *slot_weights, ids, wts, None, GPT_OSS, slot_biases)
    assert relative_error(layer.forward(x, ids, wts), ref) <= 0.01


def test_bad_activation_and_biases_are_named():
    with pytest.raises(ValueError, match="activation kind 'gelu'"):
        Glu("gelu")
    with pytest.raises(ValueError, match="activation limit -1"):
        Glu(limit=-1)
    layer = KTMoEWrapper(0, 4, 2, 256, 128, None, 2, 1, method="BF16", activation=GPT_OSS)
    with pytest.raises(ValueError, match=r"up_bias is \(4, 64\); expected \[E_src, 128\]"):
        layer.load_biases(None, torch.zeros(4, 64), None)
    bad = torch.zeros(4, 256)
    bad[2, 7] = float("nan")
    with pytest.raises(ValueError, match="down bias at row 2, column 7 is NaN"):
        layer.load_biases(None, None, bad)


def test_sglang_activation_maps_to_the_engine():
    """The plugin reads SGLang's own MoeRunnerConfig (gpt-oss: gemm1_alpha and gemm1_clamp_limit;
    DeepSeek-V4: swiglu_limit) as the engine's activation, and refuses what it cannot compute."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from kt_sglang.sglang.method import runner_activation

    assert runner_activation(MoeRunnerConfig(activation="silu")) == Glu()
    gpt_oss = MoeRunnerConfig(activation="silu", gemm1_alpha=1.702, gemm1_clamp_limit=7.0)
    assert runner_activation(gpt_oss) == GPT_OSS
    assert runner_activation(MoeRunnerConfig(activation="silu", swiglu_limit=10.0)) == DEEPSEEK_V4
    with pytest.raises(ValueError, match="uses gelu"):
        runner_activation(MoeRunnerConfig(activation="gelu", layer_id=3))
