"""Fine-tuning mode: the engine's LoRA forward and backward against torch autograd in float32 over
the same (dequantized) frozen weights and the same adapters."""

from __future__ import annotations

import pytest
import torch
from conftest import isa_params, make_hidden, make_routing, make_weights

from kt_sglang.engine import KTMoEWrapper
from kt_sglang.engine.canonical import dequantize, quantize, random_experts
from kt_sglang.engine.methods import METHODS, Method
from kt_sglang.engine.reference import relative_error
from kt_sglang.engine.sft import LORA_TENSORS, SFTMoEWrapper, parse_sft_method

ALL_METHODS = [m.value for m in Method]
GRAD_BOUND = 1e-2


def build_layer(method: str, E: int, k: int, H: int, I: int, *, rank=8, alpha=16.0, isa=None, seed=0,
                threads=2, pools=1, numa_nodes=None, skip_lora=False, max_cache_depth=1):  # fmt: skip
    """An SFT layer of random frozen experts in `method`, and their float32 values."""
    name = method + ("_SkipLoRA" if skip_lora else "")
    layer = KTMoEWrapper(
        0, E, k, H, I, None, threads, pools, method=name, mode="sft", lora_rank=rank, lora_alpha=alpha,
        isa=isa, numa_nodes=numa_nodes, max_cache_depth=max_cache_depth,
    )  # fmt: skip
    if METHODS[Method(parse_sft_method(method)[0])].quantizes_dense:
        dense = make_weights(E, I, H, seed=seed)
        mats = [[quantize(method, w[e]) for e in range(E)] for w in dense]
        layer.load_canonical(*mats)
        ref = tuple(
            torch.stack([dequantize(method, m, w.shape[2]) for m in ms])
            for ms, w in zip(mats, dense, strict=True)
        )
    else:
        mats, ref = random_experts(method, E, I, H, seed=seed)
        layer.load_canonical(*mats)
    return layer, ref


def make_adapters(layer: SFTMoEWrapper, seed: int = 3, dtype=torch.float32, scale: float = 0.1):
    gen = torch.Generator().manual_seed(seed)
    shapes = layer.lora_shapes()
    lora = [
        (torch.randn(shapes[n], generator=gen) * scale / shapes[n][2] ** 0.5 * 4).to(dtype)
        for n, _, _ in LORA_TENSORS
    ]
    grads = [torch.zeros_like(t) for t in lora]
    layer.init_lora_weights(*lora, *grads)
    return lora, grads


def reference(hidden, ids, weights, frozen, lora, scale, grad_out):
    """Float32 torch autograd: output and gradients to hidden, weights and each adapter."""
    x = hidden.float().clone().requires_grad_()
    w = weights.float().clone().requires_grad_()
    L = [t.float().clone().requires_grad_() for t in lora]
    gate, up, down = (f.float() for f in frozen)
    out = torch.zeros(x.shape)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        g = xe @ gate[e].T + scale * (xe @ L[0][e].T) @ L[1][e].T
        u = xe @ up[e].T + scale * (xe @ L[2][e].T) @ L[3][e].T
        h = torch.nn.functional.silu(g) * u
        y = h @ down[e].T + scale * (h @ L[4][e].T) @ L[5][e].T
        out = out.index_add(0, tok, y * w[tok, slot][:, None])
    out.backward(grad_out.float())
    return out.detach(), x.grad, w.grad, [t.grad for t in L]


def run_step(layer, hidden, ids, weights, grad_out):
    out = layer.forward(hidden, ids, weights, save_for_backward=True)
    grad_in, grad_w = layer.backward(grad_out)
    return out, grad_in, grad_w


def check_against_reference(layer, frozen, lora, grads, hidden, ids, weights, grad_out, bound=GRAD_BOUND):
    out, grad_in, grad_w = run_step(layer, hidden, ids, weights, grad_out)
    scale = layer.lora_alpha / layer.lora_rank
    r_out, r_in, r_w, r_lora = reference(hidden, ids, weights, frozen, lora, scale, grad_out)
    # The forward's error is the activations' bf16 rounding (and bf16 h).
    assert relative_error(out, r_out) < bound
    assert relative_error(grad_in, r_in) < bound, relative_error(grad_in, r_in)
    assert relative_error(grad_w, r_w) < bound, relative_error(grad_w, r_w)
    for (name, _, _), got, want in zip(LORA_TENSORS, grads, r_lora, strict=True):
        assert relative_error(got, want) < bound, (name, relative_error(got, want))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("method", ALL_METHODS)
def test_gradients_match_autograd(method, isa):
    E, k, H, I, T = 8, 3, 256, 192, 24
    layer, frozen = build_layer(method, E, k, H, I, isa=isa)
    lora, grads = make_adapters(layer)
    ids, weights = make_routing(T, E, k, skip_fraction=0.1)
    hidden = make_hidden(T, H)
    grad_out = make_hidden(T, H, seed=7)
    check_against_reference(layer, frozen, lora, grads, hidden, ids, weights, grad_out)
