"""Fine-tuning mode: the engine's LoRA forward and backward against torch autograd in float32 over
the same (dequantized) frozen weights and the same adapters."""

from __future__ import annotations

import pytest
import torch
from conftest import AMX_ISAS, isa_params, make_hidden, make_routing, make_weights

from kt_sglang.engine import KTMoEWrapper, SharedRunner
from kt_sglang.engine.canonical import dequantize, quantize, random_experts
from kt_sglang.engine.config import parse_sft_method
from kt_sglang.engine.methods import METHODS, Method
from kt_sglang.engine.native import _native
from kt_sglang.engine.reference import relative_error
from kt_sglang.engine.sft import LORA_TENSORS, SFTMoEWrapper

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


@pytest.mark.parametrize("isa", isa_params(("avx2", "avx512", "amx", "amx-emu")))
@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "AMXINT4", "GPTQ_INT4", "MXFP4", "NVFP4"])
def test_isa_paths_agree_with_the_scalar_twin(method, isa):
    """The backward's transposed products decode the packed panels per ISA: every gradient agrees with
    the scalar path's (the same bf16 weights; only sums and bf16 roundings of h may differ). On AMX the
    bf16-input products of the integer methods also round each dequantized weight to bf16 (2^-9
    relative, test_kernels' AMX twin bound per product): 0.0044-0.0048 on `out` after three products."""
    E, k, H, I, T = 6, 2, 192, 160, 19
    results = []
    for path in ("scalar", isa):
        SharedRunner.reset()
        layer, _ = build_layer(method, E, k, H, I, isa=path)
        _, grads = make_adapters(layer)
        ids, weights = make_routing(T, E, k)
        out, grad_in, grad_w = run_step(layer, make_hidden(T, H), ids, weights, make_hidden(T, H, seed=7))
        results.append((out.float(), grad_in, grad_w, *grads))
    names = ["out", "grad_in", "grad_weights", *[n for n, _, _ in LORA_TENSORS]]
    bound = 6e-3 if isa in AMX_ISAS and method in ("AMXINT8", "AMXINT4") else 2e-3
    for name, a, b in zip(names, *results, strict=True):
        assert relative_error(b, a) < bound, (name, relative_error(b, a))


@pytest.mark.parametrize("isa", isa_params())
def test_fine_tuning_kernels_follow_the_path(isa):
    """The adapters' loops, the tile transpose and the decoded methods' tile decode come from the ISA's
    kernel table (kernels/<isa>/lora_ops.cpp); AMX adds nothing to them, so its table takes AVX-512's."""
    expected = "avx512" if isa in AMX_ISAS else isa
    assert _native.kernel_families(isa)["fine-tuning (adapters, transposed tiles)"] == expected


# Odd shapes: hidden and intermediate not multiples of the blocks, many experts, top-8, skipped slots
# and experts masked off (computed elsewhere).
ODD_SHAPES = [
    pytest.param(64, 8, 2560, 320, 40, id="E64-k8-H2560-I320"),
    pytest.param(20, 5, 200, 72, 33, id="E20-k5-H200-I72"),
]


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "AMXINT4", "MXFP4"])
@pytest.mark.parametrize("E,k,H,I,T", ODD_SHAPES)
def test_odd_shapes_and_masked_experts(method, isa, E, k, H, I, T):
    if isa == "scalar" and H > 1024:
        T = 6  # the scalar twin is slow at this size; the shape is what matters
    layer, frozen = build_layer(method, E, k, H, I, isa=isa, rank=16)
    layer.gpu_experts_mask = torch.zeros(E, dtype=torch.bool)
    layer.gpu_experts_mask[1::7] = True  # experts computed elsewhere: no output, no gradient here
    lora, grads = make_adapters(layer)
    ids, weights = make_routing(T, E, k, skip_fraction=0.15)
    hidden, grad_out = make_hidden(T, H), make_hidden(T, H, seed=7)
    masked = ids.clone()
    masked[layer.gpu_experts_mask[ids.clamp_min(0)] & (ids >= 0)] = -1
    out, grad_in, grad_w = run_step(layer, hidden, ids, weights, grad_out)
    scale = layer.lora_alpha / layer.lora_rank
    r_out, r_in, r_w, r_lora = reference(hidden, masked, weights, frozen, lora, scale, grad_out)
    assert relative_error(out, r_out) < GRAD_BOUND
    assert relative_error(grad_in, r_in) < GRAD_BOUND
    assert relative_error(grad_w, r_w) < GRAD_BOUND
    assert torch.all(grad_w[masked < 0] == 0)
    for (name, _, _), got, want in zip(LORA_TENSORS, grads, r_lora, strict=True):
        assert relative_error(got, want) < GRAD_BOUND, name
        assert torch.all(got[layer.gpu_experts_mask] == 0), name  # masked experts get no gradient


@pytest.mark.parametrize("method", ["BF16", "AMXINT4", "NVFP4"])
def test_pools_and_threads_agree(method):
    """Two pools split the intermediate channels: the adapters' terms are added once (added twice they
    would move the result by their whole share). The split sums the down projection in another
    grouping: 1.7e-5 on Emerald Rapids' tile unit (its bf16 sums are not rounded per product as the
    SDM writes), under 1e-5 on the other paths and the tile model."""
    E, k, H, I, T = 8, 2, 128, 192, 21
    results = []
    for threads, pools, nodes in ((1, 1, None), (2, 2, [0, 0])):
        SharedRunner.reset()
        layer, frozen = build_layer(method, E, k, H, I, threads=threads, pools=pools, numa_nodes=nodes)
        lora, grads = make_adapters(layer)
        ids, weights = make_routing(T, E, k)
        out, grad_in, grad_w = run_step(layer, make_hidden(T, H), ids, weights, make_hidden(T, H, seed=7))
        results.append((out.float(), grad_in, grad_w, *grads))
    for a, b in zip(*results, strict=True):
        assert relative_error(a, b) < 1e-4


def test_bf16_adapters():
    E, k, H, I, T = 8, 2, 128, 64, 16
    layer, frozen = build_layer("BF16", E, k, H, I)
    lora, grads = make_adapters(layer, dtype=torch.bfloat16)
    ids, weights = make_routing(T, E, k)
    check_against_reference(
        layer, frozen, lora, grads, make_hidden(T, H), ids, weights, make_hidden(T, H, seed=7), bound=2e-2
    )


def test_gradients_accumulate_across_micro_batches():
    E, k, H, I = 8, 2, 128, 64
    layer, frozen = build_layer("AMXINT8", E, k, H, I, max_cache_depth=2)
    lora, grads = make_adapters(layer)
    scale = layer.lora_alpha / layer.lora_rank
    batches = [(make_hidden(T, H, seed=T), *make_routing(T, E, k, seed=T), make_hidden(T, H, seed=T + 1))
               for T in (5, 11)]  # fmt: skip
    for hidden, ids, weights, _ in batches:  # two forwards wait, then their backwards, oldest first
        layer.forward(hidden, ids, weights)
    assert layer.cache_depth == 2
    for *_, grad_out in batches:
        layer.backward(grad_out)
    assert layer.cache_depth == 0
    expected = [torch.zeros_like(g) for g in grads]
    for hidden, ids, weights, grad_out in batches:
        for acc, g in zip(
            expected, reference(hidden, ids, weights, frozen, lora, scale, grad_out)[3], strict=True
        ):
            acc += g
    for (name, _, _), got, want in zip(LORA_TENSORS, grads, expected, strict=True):
        assert relative_error(got, want) < GRAD_BOUND, name


def test_skip_lora_gives_the_input_gradient_only():
    """SkipLoRA: adapters with B = 0 (PEFT's start) add nothing, so its input gradient is the full
    mode's; it leaves the adapters' gradients alone."""
    E, k, H, I, T = 8, 2, 128, 64, 16
    ids, weights = make_routing(T, E, k)
    hidden, grad_out = make_hidden(T, H), make_hidden(T, H, seed=7)
    results = {}
    for skip in (False, True):
        layer, _ = build_layer("AMXINT4", E, k, H, I, skip_lora=skip)
        lora, grads = make_adapters(layer)
        for t in (lora[1], lora[3], lora[5]):
            t.zero_()
        results[skip] = (*run_step(layer, hidden, ids, weights, grad_out), grads)
    full, skip = results[False], results[True]
    assert relative_error(skip[1], full[1]) < 1e-6
    assert relative_error(skip[2], full[2]) < 1e-6
    assert all(torch.all(g == 0) for g in skip[3])
    assert any(torch.any(g != 0) for g in full[3])


def test_finite_differences_scalar():
    """The engine's gradients against central differences of the engine's own forward (scalar path),
    along a random direction of the adapters and of the routing weights."""
    E, k, H, I, T = 4, 2, 64, 64, 8
    layer, _ = build_layer("BF16", E, k, H, I, isa="scalar", rank=4, alpha=4.0)
    lora, grads = make_adapters(layer, scale=1.0)
    ids, weights = make_routing(T, E, k)
    hidden, grad_out = make_hidden(T, H), make_hidden(T, H, seed=7)

    def loss(w=weights) -> float:
        return float(
            (layer.forward(hidden, ids, w, save_for_backward=False).double() * grad_out.double()).sum()
        )

    _, _, grad_w = run_step(layer, hidden, ids, weights, grad_out)
    gen = torch.Generator().manual_seed(5)
    # Steps large enough that the bf16 rounding of the output (the engine's only output dtype) stays
    # well below the difference: the adapters move by 3% of their spread, the weights by 0.1.
    direction = [torch.randn(t.shape, generator=gen) * t.std() for t in lora]
    eps = 3e-2
    for t, v in zip(lora, direction, strict=True):
        t.add_(eps * v)
    plus = loss()
    for t, v in zip(lora, direction, strict=True):
        t.sub_(2 * eps * v)
    minus = loss()
    for t, v in zip(lora, direction, strict=True):
        t.add_(eps * v)
    numeric = (plus - minus) / (2 * eps)
    analytic = sum(float((g * v).sum()) for g, v in zip(grads, direction, strict=True))
    assert abs(numeric - analytic) < 2e-2 * abs(analytic)
    v, eps = torch.randn(weights.shape, generator=gen), 0.1
    numeric = (loss(weights + eps * v) - loss(weights - eps * v)) / (2 * eps)
    assert abs(numeric - float((grad_w * v).sum())) < 2e-2 * abs(numeric)


def test_a_few_training_steps_match_float32():
    """SGD on the adapters with the engine and with the float32 reference, from the same start:
    the losses stay within 1% and fall."""
    E, k, H, I, T = 8, 2, 128, 64, 32
    layer, frozen = build_layer("BF16", E, k, H, I, rank=4, alpha=8.0)
    lora, grads = make_adapters(layer)
    ref_lora = [t.clone() for t in lora]
    ids, weights = make_routing(T, E, k)
    hidden = make_hidden(T, H)
    target = make_hidden(T, H, seed=9).float()
    scale, lr = layer.lora_alpha / layer.lora_rank, 0.1
    losses, ref_losses = [], []
    for _ in range(5):
        out = layer.forward(hidden, ids, weights).float()
        losses.append(float(((out - target) ** 2).mean()))
        for g in grads:
            g.zero_()
        layer.backward(2 * (out - target) / out.numel())
        r_out = reference(hidden, ids, weights, frozen, ref_lora, scale, torch.zeros(T, H))[0]
        ref_losses.append(float(((r_out - target) ** 2).mean()))
        r_grads = reference(
            hidden, ids, weights, frozen, ref_lora, scale, 2 * (r_out - target) / r_out.numel()
        )[3]
        with torch.no_grad():
            for t, g, rt, rg in zip(lora, grads, ref_lora, r_grads, strict=True):
                t -= lr * g
                rt -= lr * rg
    for loss, ref in zip(losses, ref_losses, strict=True):
        assert abs(loss - ref) < 0.01 * ref
    assert losses[-1] < 0.95 * losses[0]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(lora_rank=0), "lora_rank"),
        (dict(lora_rank=65), "lora_rank"),
        (dict(max_cache_depth=0), "max_cache_depth"),
        (dict(lora_dropout=0.1), "lora_dropout"),
        (dict(method="NOPE_SFT"), "NOPE"),
    ],
)
def test_bad_construction(kwargs, message):
    args = dict(method="AMXBF16_SFT", mode="sft") | kwargs
    with pytest.raises(ValueError, match=message):
        KTMoEWrapper(0, 4, 2, 128, 64, None, 1, 1, **args)


def test_bad_use():
    E, k, H, I, T = 4, 2, 128, 64, 4
    layer, _ = build_layer("BF16", E, k, H, I)
    ids, weights = make_routing(T, E, k)
    hidden = make_hidden(T, H)
    with pytest.raises(RuntimeError, match="no forward cache"):
        layer.backward(hidden)
    shapes = layer.lora_shapes()
    good = [torch.zeros(shapes[n]) for n, _, _ in LORA_TENSORS]
    with pytest.raises(ValueError, match="gate_lora_a has dtype torch.float16"):
        layer.init_lora_weights(*[t.half() for t in good], *good)
    with pytest.raises(ValueError, match=r"up_lora_b has shape \(4, 64, 7\)"):
        bad = list(good)
        bad[3] = torch.zeros(4, 64, 7)
        layer.init_lora_weights(*bad, *good)
    with pytest.raises(ValueError, match="grad_down_lora_b has dtype torch.bfloat16 but"):
        layer.init_lora_weights(*good, *good[:5], good[5].bfloat16())
    with pytest.raises(ValueError, match="not contiguous"):
        layer.init_lora_weights(*good[:5], torch.zeros(4, 8, 128).transpose(1, 2), *good)
    layer.forward(hidden, ids, weights)
    with pytest.raises(RuntimeError, match="max_cache_depth=1"):
        layer.forward(hidden, ids, weights)
    with pytest.raises(ValueError, match=r"grad_output has shape \(3, 128\)"):
        layer.backward(hidden[:3])
    layer.clear_cache()  # an abandoned step: its saved state is freed, a new forward may keep one
    assert layer.cache_depth == 0
    layer.forward(hidden, ids, weights)
    bad_ids = ids.clone()
    bad_ids[1, 0] = 9
    with pytest.raises(ValueError, match="9"):
        layer.forward(hidden, bad_ids, weights, save_for_backward=False)
