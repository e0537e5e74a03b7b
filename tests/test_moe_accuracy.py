"""The engine's MoE output against the float32 torch reference, every method on every ISA path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import AMX_ISAS, SUPPORTED_ISAS, isa_params, make_hidden, make_routing, make_weights

from kt_sglang import KTMoEWrapper
from kt_sglang.engine import SharedRunner
from kt_sglang.engine.methods import METHODS as METHOD_TABLE
from kt_sglang.engine.reference import moe_reference, relative_error

# Relative L2 error bounds on N(0, 1/fan_in) weights and N(0, 1) inputs: each method's own, from the
# native table. Every method the engine quantizes runs every test here; the methods that come from
# checkpoints only run the same layers in test_int4_checkpoints.py.
BOUNDS = {m.value: info.error_bound for m, info in METHOD_TABLE.items() if info.quantizes_dense}
METHODS = tuple(BOUNDS)

# (experts, top_k, hidden, intermediate, tokens, tokens on the scalar path)
SHAPES = [
    pytest.param(8, 1, 2560, 320, 1, 1, id="E8-k1-H2560-I320-T1"),
    pytest.param(16, 8, 2560, 320, 33, 33, id="E16-k8-H2560-I320-T33"),
    pytest.param(128, 8, 256, 320, 64, 16, id="E128-k8-H256-I320-T64"),
    pytest.param(8, 2, 2560, 1408, 1024, 24, id="E8-k2-H2560-I1408-T1024"),
    pytest.param(64, 6, 384, 1408, 200, 20, id="E64-k6-H384-I1408-T200"),
    # ~230 rows on one expert: AMX runs gate/up (INT8/INT4 on bf16 inputs from 160 rows) and down in
    # several K-chunks, and H = 129 panels leaves a lone panel in the last block of output channels.
    pytest.param(2, 1, 2064, 1408, 512, 16, id="E2-k1-H2064-I1408-T512"),
    # 600 rows on each expert: more than one kernel call's 512, split into calls of 320 and 280.
    pytest.param(2, 2, 256, 320, 600, 16, id="E2-k2-H256-I320-T600"),
]


def run_layer(method, isa, gate, up, down, x, ids, weights, mask=None, threads=2, pools=1, **kw):
    E, I, H = gate.shape
    layer = KTMoEWrapper(0, E, ids.shape[1], H, I, mask, threads, pools, method=method, isa=isa, **kw)
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    return layer.forward(x, ids, weights)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("E,k,H,I,T,T_scalar", SHAPES)
def test_matches_reference(method, isa, E, k, H, I, T, T_scalar):
    T = T_scalar if isa == "scalar" else T
    gate, up, down = make_weights(E, I, H)
    ids, weights = make_routing(T, E, k, skip_fraction=0.1)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[torch.arange(0, E, 5)] = True  # these experts belong to the GPU: the CPU skips them
    x = make_hidden(T, H)
    out = run_layer(method, isa, gate, up, down, x, ids, weights, mask)
    ref = moe_reference(x, gate, up, down, ids, weights, mask)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    assert relative_error(out, ref) <= BOUNDS[method]


@pytest.mark.parametrize("isa", isa_params(("avx2", "avx512", "amx", "amx-emu")))
@pytest.mark.parametrize("method", METHODS)
def test_every_isa_agrees_with_scalar(method, isa):
    """Same packed weights, same quantized activations: only float summation order differs, except
    that AMX's down projection for INT8/INT4 (10 rows per expert here) rounds the dequantized weights
    to bf16 (2^-9 relative), which moves a few bf16 outputs by an ulp; its quality must not move."""
    E, k, H, I, T = 16, 4, 640, 448, 40
    gate, up, down = make_weights(E, I, H, seed=3)
    ids, weights = make_routing(T, E, k)
    x = make_hidden(T, H)
    expected = run_layer(method, "scalar", gate, up, down, x, ids, weights)
    actual = run_layer(method, isa, gate, up, down, x, ids, weights)
    bound = 4e-3 if isa in AMX_ISAS and method != "BF16" else 2e-3
    assert relative_error(actual, expected) <= bound
    ref = moe_reference(x, gate, up, down, ids, weights)
    assert abs(relative_error(actual, ref) - relative_error(expected, ref)) <= 5e-4


# Coarser groups trade accuracy for fewer scales; measured 0.124 / 0.142 / 0.159 for INT4 and
# 0.0125 / 0.0138 / 0.0151 for INT8 at 32 / 64 / 128. The default (64) holds issue 2's accuracy
# targets: INT8 <= 0.015, INT4 <= 0.15.
GROUP_BOUNDS = {
    ("AMXINT8", 32): 0.0145,
    ("AMXINT8", 64): 0.015,
    ("AMXINT8", 128): 0.017,
    ("AMXINT4", 32): 0.135,
    ("AMXINT4", 64): 0.15,
    ("AMXINT4", 128): 0.17,
}


@pytest.mark.parametrize("method,group_size", sorted(GROUP_BOUNDS))
def test_group_sizes(method, group_size):
    E, k, H, I, T = 8, 2, 640, 320, 48
    gate, up, down = make_weights(E, I, H, seed=4)
    ids, weights = make_routing(T, E, k)
    x = make_hidden(T, H)
    out = run_layer(method, None, gate, up, down, x, ids, weights, group_size=group_size)
    error = relative_error(out, moe_reference(x, gate, up, down, ids, weights))
    assert error <= GROUP_BOUNDS[method, group_size]


@pytest.mark.parametrize("isa", isa_params(("avx2", "avx512", "amx", "amx-emu")))
@pytest.mark.parametrize("method,group_size", sorted(GROUP_BOUNDS))
def test_group_sizes_agree_across_isas(method, group_size, isa):
    """Every group size on every path: 1 to 9 rows per expert reach both the small-batch kernels
    and AMX's (which rounds the dequantized down weights to bf16, hence its wider bound)."""
    E, k, H, I, T = 8, 2, 256, 384, 20
    gate, up, down = make_weights(E, I, H, seed=7)
    ids, weights = make_routing(T, E, k)
    x = make_hidden(T, H)
    expected = run_layer(method, "scalar", gate, up, down, x, ids, weights, group_size=group_size)
    actual = run_layer(method, isa, gate, up, down, x, ids, weights, group_size=group_size)
    assert relative_error(actual, expected) <= (4e-3 if isa in AMX_ISAS else 2e-3)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("threads,pools,numa_nodes", [(1, 1, None), (2, 1, None), (2, 2, [0, 0])])
@pytest.mark.parametrize("T", [70, 6, 300], ids=["outputs-per-token", "outputs-per-row", "75-rows-an-expert"])
def test_threads_and_pools_agree(method, threads, pools, numa_nodes, T):
    """Pools split the intermediate dimension; any split gives the same result up to rounding.
    Batches of at most 32 tokens keep each row's down projection apart and sum a token's rows.
    From 64 rows AMX INT4's down projection quantizes h with one scale per row and requantizes its
    weights per channel, each over a pool's slice of the intermediate dimension, so a split moves
    the result by that int8 rounding (measured 0.018 against INT4's own 0.146)."""
    E, k, H, I = 16, 4, 512, 704
    gate, up, down = make_weights(E, I, H, seed=5)
    ids, weights = make_routing(T, E, k)
    x = make_hidden(T, H)
    ref = moe_reference(x, gate, up, down, ids, weights)
    out = run_layer(
        method,
        None,
        gate,
        up,
        down,
        x,
        ids,
        weights,
        threads=threads,
        pools=pools,
        numa_nodes=numa_nodes,
    )
    assert relative_error(out, ref) <= BOUNDS[method]
    SharedRunner.reset()  # the process-wide pools are fixed by the first layer; start others
    single = run_layer(method, None, gate, up, down, x, ids, weights, threads=1, pools=1)
    whole_k_down = method == "AMXINT4" and T >= 64 * E // k and "amx" in SUPPORTED_ISAS
    assert relative_error(out, single) <= (0.03 if whole_k_down and pools > 1 else 2e-3)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("T", [3, 40])
def test_expert_named_twice_and_an_empty_pool(method, T):
    """A token may name one expert in two slots (both count). With one block of intermediate
    channels for two pools one pool owns none of them and must add nothing, even though its
    workers' scratch holds a previous layer's sums (layers share it), on both output paths."""
    E, k, H = 4, 3, 256
    ids, weights = make_routing(T, E, k, seed=8)
    ids[:, 1] = ids[:, 0]
    x = make_hidden(T, H)
    for idx, I in enumerate([128, 64]):  # the first layer leaves partial sums in both pools
        gate, up, down = make_weights(E, I, H, seed=8 + idx)
        layer = KTMoEWrapper(idx, E, k, H, I, None, 2, 2, method=method, numa_nodes=[0, 0])
        layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
        out = layer.forward(x, ids, weights)
        assert relative_error(out, moe_reference(x, gate, up, down, ids, weights)) <= BOUNDS[method]
    unit = max(layer.group_size, 64)  # the intermediate dimension is padded to whole groups
    assert sorted(end - begin for begin, end in layer._layer.pool_slices) == [0, -(-I // unit) * unit]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("T", [1, 5, 40])
def test_repeated_forwards_are_identical(method, T):
    """Two workers take work items in whichever order they get to them; the output must not depend
    on it (decode sums each token's rows in slot order, prefill gives each output block one worker)."""
    E, k, H, I = 16, 4, 512, 320
    gate, up, down = make_weights(E, I, H, seed=9)
    ids, weights = make_routing(T, E, k, seed=9)
    x = make_hidden(T, H)
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 1, method=method)
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    first = layer.forward(x, ids, weights)
    assert all(torch.equal(layer.forward(x, ids, weights), first) for _ in range(30))


@pytest.mark.parametrize("method", METHODS)
def test_incremental_adds_to_output(method):
    """The wrapper writes its output; the engine can also add to what is there (hybrid layer)."""
    E, k, H, I, T = 8, 2, 256, 192, 12
    gate, up, down = make_weights(E, I, H, seed=6)
    ids, weights = make_routing(T, E, k)
    x = make_hidden(T, H)
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 1, method=method)
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    base = torch.randn(T, H).bfloat16()
    out = base.clone()
    ids32 = ids.to(torch.int32).contiguous()
    task = layer._layer.submit_forward(
        T, 0, x.data_ptr(), ids32.data_ptr(), False, weights.data_ptr(), 0, out.data_ptr(), True
    )
    layer._runner.wait(task)
    expected = base.float() + moe_reference(x, gate, up, down, ids, weights)
    assert relative_error(out, expected) <= BOUNDS[method]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("T,chunk", [(600, 300), (1600, 800)], ids=["int8-inputs", "a16-from-160-rows"])
def test_prefill_in_chunks_equals_one_pass(method, T, chunk):
    """chunked_prefill_size bounds the scratch; chunking must not change the result. Every expert
    gets a quarter of the tokens of the pass and of each chunk, on the same sides of 64 rows, where
    AMX INT4 gate/up requantizes its weights per channel, and of 160, where AMX switches INT8/INT4
    gate/up to bf16 inputs (other roundings)."""
    E, k, H, I = 8, 2, 256, 320
    gate, up, down = make_weights(E, I, H, seed=7)
    t = torch.arange(T)
    ids = torch.stack([t % E, (t + 1) % E], dim=1)
    weights = torch.rand(T, k, generator=torch.Generator().manual_seed(7))
    x = make_hidden(T, H)
    whole = run_layer(method, None, gate, up, down, x, ids, weights)
    chunked = run_layer(method, None, gate, up, down, x, ids, weights, chunked_prefill_size=chunk)
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("method", METHODS)
def test_outlier_weights(method):
    """A few large entries per row, as in real checkpoints.

    Bounds: 4 entries per row scaled x20 dominate their rows' norm, so plain rounding moves
    little; group-wise scales confine the damage to the outliers' groups (for INT4 the step of such
    a group grows ~8x); FP8's e4m3 keeps its relative precision whatever the scale. Measured: BF16
    0.004, AMXINT8 0.027, AMXINT4 0.24, FP8 0.045, FP8_PERCHANNEL 0.035.
    """
    bounds = {"BF16": 0.01, "AMXINT8": 0.03, "AMXINT4": 0.25, "FP8": 0.06, "FP8_PERCHANNEL": 0.06}
    E, k, H, I, T = 16, 4, 1024, 512, 64
    gate, up, down = make_weights(E, I, H, seed=8, outliers=4)
    ids, weights = make_routing(T, E, k)
    x = make_hidden(T, H)
    out = run_layer(method, None, gate, up, down, x, ids, weights)
    assert relative_error(out, moe_reference(x, gate, up, down, ids, weights)) <= bounds[method]


def test_physical_to_logical_map_selects_experts():
    E_src, E, k, H, I, T = 12, 6, 2, 256, 192, 20
    gate, up, down = make_weights(E_src, I, H, seed=9)
    slots = [11, 3, 3, 0, 7, 5]
    ids, weights = make_routing(T, E, k)
    x = make_hidden(T, H)
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 1, method="BF16")
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16(), slots)
    ref = moe_reference(x, gate[slots], up[slots], down[slots], ids, weights)
    assert relative_error(layer.forward(x, ids, weights), ref) <= BOUNDS["BF16"]


def test_no_tokens_and_all_skipped():
    E, k, H, I = 8, 2, 256, 192
    gate, up, down = make_weights(E, I, H)
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 1, method="AMXINT8")
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    empty = layer.forward(make_hidden(0, H), torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, k))
    assert empty.shape == (0, H)
    ids = torch.full((5, k), -1)
    out = layer.forward(make_hidden(5, H), ids, torch.rand(5, k))
    assert torch.count_nonzero(out) == 0


# One process per setting: KT_SGLANG_PREFETCH_BYTES is read once per process.
PREFETCH_RUN = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from conftest import make_hidden, make_routing, make_weights
from kt_sglang import KTMoEWrapper
outs = {}
for method in ("BF16", "AMXINT8", "AMXINT4"):
    for T in (3, 40):  # at most 4 rows per expert (decode kernels), then ~10 (prefill)
        gate, up, down = make_weights(8, 320, 640, seed=11)
        ids, weights = make_routing(T, 8, 2)
        layer = KTMoEWrapper(0, 8, 2, 640, 320, None, 2, 1, method=method, isa=sys.argv[2])
        layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
        outs[method, T] = layer.forward(make_hidden(T, 640), ids, weights)
torch.save(outs, sys.argv[3])
"""


@pytest.mark.parametrize("isa", isa_params(("avx512", "amx", "amx-emu")))
def test_weight_prefetch_changes_no_result(isa, tmp_path):
    """The decode kernels' weight prefetch (on by default on Intel, off elsewhere) moves memory
    traffic only: outputs are bit-identical with it off and 4 KiB ahead."""
    outs = {}
    for ahead in ("0", "4096"):
        path = tmp_path / f"out-{ahead}.pt"
        r = subprocess.run(
            [sys.executable, "-c", PREFETCH_RUN, str(Path(__file__).parent), isa, str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,  # not the source tree, whose kt_sglang has no built engine
            env={**os.environ, "KT_SGLANG_PREFETCH_BYTES": ahead},
        )
        assert r.returncode == 0, r.stderr
        outs[ahead] = torch.load(path)
    for key, out in outs["0"].items():
        assert torch.equal(out, outs["4096"][key]), key
