"""The Triton split and hot-expert kernels against their torch twins.

Without a GPU they run in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set by conftest.py
before triton is imported) in fp32 and fp16: Triton 3.8's interpreter computes bf16 ``tl.dot``
wrongly. With a CUDA device they run compiled, bf16 included.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_routing

from kt_sglang.kernels import hot_moe_torch, split_routing_torch

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU (bf16 tl.dot is wrong in Triton's interpreter)"
)


@pytest.fixture
def device() -> str:
    if HAS_CUDA:
        return "cuda"
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets the interpreter without a GPU"
    return "cpu"


def slot_map(num_experts: int, hot: list[int]) -> torch.Tensor:
    slot_of = torch.full((num_experts,), -1, dtype=torch.int64)
    slot_of[hot] = torch.arange(len(hot))
    return slot_of


def random_hot(num_experts: int, fraction: float, seed: int) -> list[int]:
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    return sorted(order[: round(fraction * num_experts)].tolist())


@pytest.mark.parametrize("tokens", [0, 1, 37])
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (16, 6), (64, 8)])
@pytest.mark.parametrize("hot_fraction", [0.0, 0.5, 1.0])
def test_split_kernel_matches_torch(device, tokens, experts, top_k, hot_fraction):
    from kt_sglang.kernels.split_triton import split_routing_triton

    ids, weights = make_routing(tokens, experts, top_k, seed=tokens + top_k, skip_fraction=0.1)
    if tokens > 3:
        weights[3] = 0.25  # ties: the earlier slot is deferred first
    slot_of = slot_map(experts, random_hot(experts, hot_fraction, seed=experts))
    for dtype in (torch.int32, torch.int64) if top_k == 2 else (torch.int64,):
        ids_d, weights_d = ids.to(device, dtype), weights.to(device)
        before = ids_d.clone(), weights_d.clone()
        for max_deferred in range(top_k):
            want = split_routing_torch(ids, weights, slot_of, max_deferred)
            got = split_routing_triton(ids_d, weights_d, slot_of.to(device), max_deferred)
            for name in ("hot_ids", "cold_ids", "deferred_ids"):
                assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (name, max_deferred)
        assert torch.equal(ids_d, before[0]) and torch.equal(weights_d, before[1])  # router tensors untouched


def hot_case(tokens: int, slots: int, top_k: int, H: int, I: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    slot_ids = torch.randint(-1, slots, (tokens, top_k), generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    hidden = torch.randn(tokens, H, generator=gen).to(dtype)
    w13 = (torch.randn(slots, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(slots, H, I, generator=gen) / I**0.5).to(dtype)
    return hidden, w13, w2, slot_ids, weights


HOT_SHAPES = [(1, 3, 2, 64, 32), (23, 5, 4, 96, 80), (40, 8, 8, 128, 64), (0, 2, 2, 64, 32)]


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"]
)
@pytest.mark.parametrize("shape", HOT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_hot_kernel_matches_torch(device, dtype, tol, shape):
    from kt_sglang.kernels.hot_moe_triton import hot_moe_triton

    case = hot_case(*shape, dtype)
    want = hot_moe_torch(*case)
    got = hot_moe_triton(*(t.to(device) for t in case)).cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    if shape[0]:
        assert float((got - want).norm() / want.norm()) < tol


def test_hot_kernel_skips_cold_and_empty(device):
    from kt_sglang.kernels.hot_moe_triton import hot_moe_triton

    hidden, w13, w2, slot_ids, weights = hot_case(9, 4, 2, 64, 32, torch.float32)
    slot_ids[:] = -1
    slot_ids[4, 1] = 2  # one hot selection in the whole batch
    got = hot_moe_triton(*(t.to(device) for t in (hidden, w13, w2, slot_ids, weights))).cpu()
    assert torch.count_nonzero(got.abs().sum(1)) == 1 and got[4].abs().sum() > 0
    assert torch.allclose(got, hot_moe_torch(hidden, w13, w2, slot_ids, weights), atol=1e-5)
    no_slots = hot_moe_triton(
        hidden.to(device), w13[:0].to(device), w2[:0].to(device), slot_ids.to(device), weights
    )
    assert not no_slots.any()


@pytest.mark.parametrize(("tokens", "top_k", "slots"), [(50, 4, 6), (1, 8, 3), (128, 8, 40), (7, 2, 1)])
def test_align_by_slot_places_each_hot_selection_once(device, tokens, top_k, slots):
    """The one-program alignment: every hot selection in exactly one block of its slot, and the same
    layout as the torch ops (stable order within a slot)."""
    from kt_sglang.kernels.hot_moe_triton import BLOCK_M, align_by_slot, align_by_slot_torch

    slot_ids = torch.randint(-1, slots, (tokens, top_k), generator=torch.Generator().manual_seed(tokens))
    blocks = align_by_slot(slot_ids.to(device), slots)
    rows, block_slot = blocks.rows.cpu(), blocks.block_slot.cpu()
    flat = slot_ids.reshape(-1)
    seen = {}
    for b, s in enumerate(block_slot.tolist()):
        for r in rows[b * BLOCK_M : (b + 1) * BLOCK_M].tolist():
            if r < flat.numel():
                assert s >= 0 and int(flat[r]) == s, (b, r)
                seen[r] = seen.get(r, 0) + 1
    assert seen == {r: 1 for r in range(flat.numel()) if flat[r] >= 0}
    twin = align_by_slot_torch(slot_ids, slots)
    assert torch.equal(rows, twin.rows) and torch.equal(block_slot, twin.block_slot)


@needs_gpu
@pytest.mark.parametrize("shape", HOT_SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_hot_kernel_bf16_on_gpu(shape):
    from kt_sglang.kernels.hot_moe_triton import hot_moe_triton

    case = hot_case(*shape, torch.bfloat16)
    want = hot_moe_torch(*case)
    got = hot_moe_triton(*(t.cuda() for t in case)).cpu()
    assert float((got - want).norm() / want.norm()) < 1e-2


# aten ops that launch no kernel on a GPU (allocation, views, no-op conversions)
_NO_LAUNCH = {
    "empty", "empty_strided", "view", "_unsafe_view", "reshape", "select", "slice", "as_strided",
    "detach", "alias", "t", "transpose", "unsqueeze", "squeeze", "expand", "permute", "new_empty",
    "lift_fresh",
}  # fmt: skip


def _launches(fn) -> tuple[int, int]:
    """(Triton kernel launches, launching aten ops outside them) of ``fn()`` in the interpreter."""
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    state = {"inside": False, "triton": 0, "aten": []}
    run = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        state["triton"] += 1
        state["inside"] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            state["inside"] = False

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not state["inside"] and name not in _NO_LAUNCH:
                state["aten"].append(name)
            return func(*args, **(kwargs or {}))

    interpreter.GridExecutor.__call__ = counted
    try:
        with Count():
            fn()
    finally:
        interpreter.GridExecutor.__call__ = run
    return state["triton"], len(state["aten"])


def _launches_on_gpu(fn) -> tuple[int, int]:
    """(Triton kernels, other kernels and memsets) of ``fn()`` as the GPU's own profiler records them."""
    import triton
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kt_sglang.kernels import hot_moe_triton, split_triton

    ours = {
        f.fn.__name__
        for module in (hot_moe_triton, split_triton)
        for f in vars(module).values()
        if isinstance(f, triton.runtime.JITFunction)
    }
    fn()  # compiled and cached before counting
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    triton_launches = sum(name in ours for name in names)
    return triton_launches, len(names) - triton_launches


def hot_path_launch_counts(device: str = "cpu") -> set[tuple[int, int]]:
    """(Triton kernels, launching torch ops) of one layer's eager hot path, per case: in Triton's
    interpreter on the CPU, by the profiler on a GPU."""
    from kt_sglang.kernels.hot_moe_triton import hot_moe_triton
    from kt_sglang.kernels.split_triton import split_routing_triton

    E, k, H, I = 32, 4, 64, 32
    counts = set()
    for tokens, hot_fraction in [(1, 0.1), (1, 0.5), (16, 0.25), (64, 1.0)]:
        hot = random_hot(E, hot_fraction, seed=tokens)
        slot_of = slot_map(E, hot).to(device)
        w13 = torch.randn(len(hot), 2 * I, H, device=device)
        w2 = torch.randn(len(hot), H, I, device=device)
        ids, weights = (t.to(device) for t in make_routing(tokens, E, k, seed=tokens))
        x = torch.randn(tokens, H, device=device)

        def step(ids=ids, weights=weights, slot_of=slot_of, x=x, w13=w13, w2=w2):
            split = split_routing_triton(ids, weights, slot_of, 1)
            hot_moe_triton(x, w13, w2, split.hot_ids, weights)

        counts.add(_launches_on_gpu(step) if device == "cuda" else _launches(step))
    return counts


def test_hot_path_launches_are_bounded(tmp_path):
    """The hot path of one layer in eager mode (split, alignment, gate/up, down, sum): the same number
    of launches at any batch size and share of hot experts, five Triton kernels at most and a
    handful of torch ops. On a GPU the profiler counts the kernels the device ran (Triton 3.6's
    interpreter cannot run the alignment kernel beside NumPy 2.5); without one, Triton's interpreter
    counts the launches, in a process of its own (TRITON_INTERPRET is read at import)."""
    if torch.cuda.is_available():
        counts = hot_path_launch_counts("cuda")
    else:
        here = Path(__file__).resolve().parent
        code = (
            f"import sys; sys.path.insert(0, {str(here)!r}); import test_triton_kernels as t; "
            "print(sorted(t.hot_path_launch_counts()))"
        )
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
        )
        assert r.returncode == 0, r.stderr[-3000:]
        counts = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    assert len(counts) == 1, counts
    ((triton_launches, aten_launches),) = counts
    assert triton_launches <= 5 and aten_launches <= 6, counts


# -- the streamed experts' MoE from the packed layout (kernels/packed_moe_triton.py) -------------------


def packed_case(method, E: int, H: int, I: int, pools: int, tokens: int, top_k: int, seed: int = 0):
    """A layer of canonical experts packed by the engine (expert 1 not held: absent from its memory),
    the held ones staged in reverse order as the GPU prefill stages a round, and random selections of
    them (-1 included). Returns (layout, gate_up, down, hidden, slot_ids, weights, expert_ids, float32
    gate, up, down of every expert)."""
    from kt_sglang import KTMoEWrapper
    from kt_sglang.engine.canonical import dequantize, quantize, random_canonical
    from kt_sglang.engine.methods import METHODS
    from kt_sglang.layer.prefill import PackedExperts

    gen = torch.Generator().manual_seed(seed)
    mats = []
    for j, (N, K) in enumerate(((I, H), (I, H), (H, I))):
        if METHODS[method].quantizes_dense:
            mats.append([quantize(method, torch.randn(N, K, generator=gen) / K**0.5) for _ in range(E)])
        else:
            mats.append([random_canonical(method, N, K, seed=seed * 100 + 3 * e + j) for e in range(E)])
    held_out = torch.zeros(E, dtype=torch.bool)
    held_out[1] = True
    layer = KTMoEWrapper(
        0, E, top_k, H, I, held_out, pools, pools, method=method.value, numa_nodes=[0] * pools
    )
    layer.load_canonical(*mats)
    packed = PackedExperts(layer)
    order = packed.held[::-1]
    rows = torch.tensor([packed.row_of[e] for e in order])
    gate_up = [g[rows].clone() for g in packed.gate_up]
    down = [d[rows].clone() for d in packed.down]
    slot_ids = torch.randint(-1, len(order), (tokens, top_k), generator=gen)
    slot_ids[:1, 0] = 0  # at least one selection has an expert
    expert_ids = torch.where(slot_ids >= 0, torch.tensor(order)[slot_ids.clamp_min(0)], -1)
    weights = torch.rand(tokens, top_k, generator=gen)
    hidden = torch.randn(tokens, H, generator=gen)
    groups = (layer.group_size, layer.group_size, layer.down_group_size)
    full = [
        torch.stack([dequantize(method, m, K, g) for m in ms])
        for ms, K, g in zip(mats, (H, H, I), groups, strict=True)
    ]
    return packed.layout, gate_up, down, hidden, slot_ids, weights, expert_ids, full


PACKED_METHODS = [
    "BF16",
    "AMXINT8",
    "AMXINT4",
    "FP8",
    "FP8_PERCHANNEL",
    "RAWINT4",
    "GPTQ_INT4",
    "MXFP4",
    "NVFP4",
]


@pytest.mark.parametrize("pools", [1, 2])
@pytest.mark.parametrize("method", PACKED_METHODS)
def test_packed_kernel_matches_the_decoded_experts(device, method, pools):
    """fp32 and fp16 GEMMs over the packed bytes (H and I not multiples of 64, one and two pools, -1
    selections): against `hot_moe_torch` on the `decode_experts` weights, and in fp32 against the
    float32 MoE of the method's own values (exact weights: only the summation order differs)."""
    from kt_sglang.engine.methods import Method
    from kt_sglang.engine.reference import moe_reference, relative_error
    from kt_sglang.kernels.packed import decode_experts
    from kt_sglang.kernels.packed_moe_triton import packed_moe_triton

    layout, gate_up, down, hidden, slot_ids, weights, expert_ids, full = packed_case(
        Method(method), E=4, H=160, I=200 if pools == 2 else 96, pools=pools, tokens=21, top_k=3
    )
    assert len([p for p in layout.pools if p.i_end > p.i_begin]) == pools
    want_fp32 = moe_reference(hidden, *full, expert_ids, weights)
    # On a GPU, half precision is `test_packed_kernel_bf16_on_gpu`'s (each dtype compiles every kernel).
    dtypes = ((torch.float32, 1e-5),) if HAS_CUDA else ((torch.float32, 1e-5), (torch.float16, 2e-3))
    for dtype, tol in dtypes:
        x = hidden.to(dtype)
        want = hot_moe_torch(x, *decode_experts(layout, gate_up, down, dtype), slot_ids, weights)
        got = packed_moe_triton(
            x.to(device), layout, [g.to(device) for g in gate_up], [d.to(device) for d in down],
            slot_ids.to(device), weights.to(device), dtype=dtype,
        ).cpu()  # fmt: skip
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert relative_error(got, want) < tol, (dtype, relative_error(got, want))
        if dtype == torch.float32:
            assert relative_error(got, want_fp32) < tol, relative_error(got, want_fp32)


@pytest.mark.parametrize(
    ("experts", "tokens", "top_k", "block_m"),
    [(2, 1, 1, None), (6, 37, 4, 16), (9, 70, 2, 64), (4, 0, 2, None)],
    ids=lambda v: str(v),
)
def test_packed_kernel_expert_and_token_counts(device, experts, tokens, top_k, block_m):
    """Rounds of 1 to 8 experts, 0 to 70 tokens, blocks of 16 and 64 selections (AMXINT8, fp32)."""
    from kt_sglang.engine.methods import Method
    from kt_sglang.kernels.packed import decode_experts
    from kt_sglang.kernels.packed_moe_triton import packed_moe_triton

    layout, gate_up, down, hidden, slot_ids, weights, _, _ = packed_case(
        Method.AMXINT8, E=experts, H=96, I=40, pools=1, tokens=tokens, top_k=top_k, seed=experts
    )
    want = hot_moe_torch(hidden, *decode_experts(layout, gate_up, down, torch.float32), slot_ids, weights)
    args = (
        [g.to(device) for g in gate_up],
        [d.to(device) for d in down],
        slot_ids.to(device),
        weights.to(device),
    )
    got = packed_moe_triton(hidden.to(device), layout, *args, dtype=torch.float32, block_m=block_m).cpu()
    assert got.shape == (tokens, 96)
    if tokens:
        assert float((got - want).norm() / want.norm()) < 1e-5
    none = packed_moe_triton(
        hidden.to(device), layout, *args[:2], torch.full_like(args[2], -1), args[3], dtype=torch.float32
    )
    assert not none.any()  # selections without an expert add nothing


def test_packed_kernel_refuses_bytes_of_another_layout(device):
    from kt_sglang.engine.methods import Method
    from kt_sglang.kernels.packed_moe_triton import packed_moe_triton

    layout, gate_up, down, hidden, slot_ids, weights, _, _ = packed_case(
        Method.AMXINT4, E=3, H=64, I=32, pools=1, tokens=2, top_k=1
    )
    cut = [g[:, :-1].contiguous() for g in gate_up]
    with pytest.raises(ValueError, match=r"gate_up\[0\].*expected contiguous uint8"):
        packed_moe_triton(hidden, layout, cut, down, slot_ids, weights)
    with pytest.raises(ValueError, match="the layout's hidden size is 64"):
        packed_moe_triton(hidden[:, :32], layout, gate_up, down, slot_ids, weights)


@needs_gpu
@pytest.mark.parametrize("pools", [1, 2])
@pytest.mark.parametrize("method", PACKED_METHODS)
def test_packed_kernel_bf16_on_gpu(method, pools):
    """bf16 GEMMs on the device, blocks of 16 and 64 selections: against `hot_moe_torch` on the bf16
    `decode_experts` weights, and against the float32 MoE within bf16 rounding."""
    from kt_sglang.engine.methods import Method
    from kt_sglang.engine.reference import moe_reference, relative_error
    from kt_sglang.kernels.packed import decode_experts
    from kt_sglang.kernels.packed_moe_triton import packed_moe_triton

    for tokens in (5, 300):
        layout, gate_up, down, hidden, slot_ids, weights, expert_ids, full = packed_case(
            Method(method), E=5, H=160, I=200 if pools == 2 else 96, pools=pools, tokens=tokens, top_k=4
        )
        x = hidden.bfloat16()
        want = hot_moe_torch(x, *decode_experts(layout, gate_up, down, torch.bfloat16), slot_ids, weights)
        got = packed_moe_triton(
            x.cuda(),
            layout,
            [g.cuda() for g in gate_up],
            [d.cuda() for d in down],
            slot_ids.cuda(),
            weights.cuda(),
        ).cpu()
        assert relative_error(got, want) < 1e-2, (tokens, relative_error(got, want))
        reference = moe_reference(x.float(), *full, expert_ids, weights)
        assert relative_error(got, reference) < 1e-2, (tokens, relative_error(got, reference))
