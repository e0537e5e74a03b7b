"""The software model of the AMX tile unit (native/src/kernels/amx/tile_model.h): each instruction
against a plain definition written here from the Intel SDM, on full and partial tiles; the faults
the SDM lists; on a CPU with AMX, every instruction bit for bit against the tile unit itself."""

from __future__ import annotations

import struct

import pytest
import torch
from conftest import SUPPORTED_ISAS, make_hidden, make_weights

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.native import _native

INT8_DOTS = {
    "dpbssd": (True, True),
    "dpbsud": (True, False),
    "dpbusd": (False, True),
    "dpbuud": (False, False),
}
# (rows of dst and a, bytes per row of a = 4 * rows of b, bytes per row of dst and b)
SHAPES = [(16, 64, 64), (3, 12, 20), (9, 64, 16), (1, 4, 4), (16, 28, 64)]


def config(tiles: dict[int, tuple[int, int]], palette: int = 1) -> torch.Tensor:
    """A 64-byte LDTILECFG operand: tile -> (rows, bytes per row)."""
    colsb = [0] * 16
    rows = [0] * 16
    for t, (r, c) in tiles.items():
        rows[t], colsb[t] = r, c
    raw = struct.pack("<BB14x16H16B", palette, 0, *colsb, *rows)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def run(backend: str, cfg: torch.Tensor, program: list[tuple]) -> None:
    _native.amx_tile_program(backend, cfg.data_ptr(), program)


def dot_program(op: str, m: int, ka: int, n: int, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """C (m x n bytes) += A (m x ka bytes) . B (ka / 4 x n bytes) on tiles 0, 1, 2; rows 64 bytes apart."""
    cfg = config({0: (m, n), 1: (m, ka), 2: (ka // 4, n)})
    prog = [
        ("load", 0, c.data_ptr(), 64),
        ("load", 1, a.data_ptr(), 64),
        ("load", 2, b.data_ptr(), 64),
        (op, 0, 1, 2),
        ("store", 0, c.data_ptr(), 64),
    ]
    return cfg, prog


def reference_int8(op, m, ka, n, c, a, b):
    """SDM TDPB[SU][SU]D: per dword of C, the four byte products of A's row and B's column, int32 wrap."""
    a_signed, b_signed = INT8_DOTS[op]
    av = a[:m, :ka].to(torch.int64)
    bv = b[: ka // 4, :n].to(torch.int64)
    if not a_signed:
        av = av % 256
    if not b_signed:
        bv = bv % 256
    A = av.reshape(m, ka // 4, 4)
    B = bv.reshape(ka // 4, n // 4, 4)
    acc = c[:m].view(torch.int32)[:, : n // 4].to(torch.int64) + torch.einsum("mkj,knj->mn", A, B)
    acc = (acc + 2**31) % 2**32 - 2**31
    return acc.to(torch.int32)


def bf16_daz(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int16)
    denormal = (bits & 0x7F80) == 0
    return torch.where(denormal, (bits & -0x8000).view(torch.bfloat16), x).float()


def reference_bf16(m, ka, n, c, a, b):
    """SDM TDPBF16PS: each fp32 sum += the two bf16 products in order, one rounding each (the product is
    exact), denormal inputs read as zero, denormal sums flushed to zero."""
    A = bf16_daz(a[:m].view(torch.bfloat16)[:, : ka // 2]).double()
    B = bf16_daz(b[: ka // 4].view(torch.bfloat16)[:, : n // 2]).double()
    acc = c[:m].view(torch.float32)[:, : n // 4].clone()
    tiny = torch.finfo(torch.float32).tiny
    for k in range(ka // 4):
        for e in range(2):
            s = (acc.double() + A[:, 2 * k + e, None] * B[None, k, e::2]).float()
            acc = torch.where(s.abs() < tiny, torch.zeros_like(s).copysign(s), s)
    return acc


def random_bytes(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(
        -128, 128, (rows, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(seed)
    )


def random_bf16_rows(rows: int, seed: int, denormals: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32, generator=gen).bfloat16()
    if denormals:  # a few bf16 denormals (exponent field 0)
        tiny = (torch.randint(1, 127, (rows, 32), generator=gen, dtype=torch.int16)).view(torch.bfloat16)
        x = torch.where(torch.rand(rows, 32, generator=gen) < 0.2, tiny, x)
    return x.view(torch.uint8).reshape(rows, 64).view(torch.int8).clone()


@pytest.mark.parametrize("op", list(INT8_DOTS))
@pytest.mark.parametrize("m,ka,n", SHAPES)
def test_integer_dot_products_follow_the_sdm(op, m, ka, n):
    c0, a, b = random_bytes(16, 1), random_bytes(16, 2), random_bytes(16, 3)
    c = c0.clone()
    cfg, prog = dot_program(op, m, ka, n, c, a, b)
    run("model", cfg, prog)
    assert torch.equal(c[:m].view(torch.int32)[:, : n // 4], reference_int8(op, m, ka, n, c0, a, b))
    # Only the configured rows and bytes of C are stored.
    assert torch.equal(c[m:], c0[m:]) and torch.equal(c[:m, n:], c0[:m, n:])


@pytest.mark.parametrize("m,ka,n", SHAPES)
@pytest.mark.parametrize("denormals", [False, True], ids=["normal", "denormal"])
def test_bf16_dot_product_follows_the_sdm(m, ka, n, denormals):
    a, b = random_bf16_rows(16, 4, denormals), random_bf16_rows(16, 5, denormals)
    c0 = torch.randn(16, 16, generator=torch.Generator().manual_seed(6))
    if denormals:
        c0[0, :4] = torch.tensor([1e-39, -1e-39, 3e-45, 0.0])  # fp32 denormal sums in C
    c0 = c0.view(torch.int8).reshape(16, 64).clone()
    c = c0.clone()
    cfg, prog = dot_program("dpbf16ps", m, ka, n, c, a, b)
    run("model", cfg, prog)
    got = c[:m].view(torch.float32)[:, : n // 4]
    assert torch.equal(got, reference_bf16(m, ka, n, c0, a, b))
    assert torch.equal(c[m:], c0[m:]) and torch.equal(c[:m, n:], c0[:m, n:])


def test_loads_read_only_configured_bytes_and_zero_the_rest():
    """A tile of 5 rows x 24 bytes is loaded from rows 100 bytes apart, stored 64 apart; the model
    reads exactly 5 x 24 bytes (counted) and C's unconfigured part stays as it was."""
    src = torch.arange(600, dtype=torch.int32).to(torch.uint8)
    dst = torch.full((16, 64), 0xEE, dtype=torch.uint8)
    _native.amx_model_reset_counters()
    run("model", config({3: (5, 24)}), [("load", 3, src.data_ptr(), 100), ("store", 3, dst.data_ptr(), 64)])
    counts = _native.amx_model_counters()
    assert counts["load_bytes"] == 5 * 24 and counts["store_bytes"] == 5 * 24
    for r in range(5):
        assert torch.equal(dst[r, :24], src[100 * r : 100 * r + 24])
    assert (dst[5:] == 0xEE).all() and (dst[:5, 24:] == 0xEE).all()


def test_zero_and_accumulate_across_instructions():
    """tilezero then two dot products accumulate; a dot on zeroed tiles leaves zero."""
    a, b = random_bytes(16, 7), random_bytes(16, 8)
    c = torch.zeros(16, 64, dtype=torch.int8)
    cfg = config({0: (16, 64), 1: (16, 64), 2: (16, 64)})
    prog = [("zero", 0), ("load", 1, a.data_ptr(), 64), ("load", 2, b.data_ptr(), 64)]
    prog += [("dpbssd", 0, 1, 2), ("dpbssd", 0, 1, 2), ("store", 0, c.data_ptr(), 64)]
    run("model", cfg, prog)
    once = reference_int8("dpbssd", 16, 64, 64, torch.zeros(16, 64, dtype=torch.int8), a, b)
    assert torch.equal(c.view(torch.int32), (once.to(torch.int64) * 2).to(torch.int32))


FAULTS = [
    (config({0: (16, 64)}, palette=2), [], "palette 2"),
    (config({0: (17, 64)}), [], "17 rows"),
    (config({0: (16, 68)}), [], "68 bytes"),
    (config({0: (0, 64)}), [], "only one of rows"),
    (config({9: (16, 64)}), [], "palette 1 has 8 tiles"),
    (config({0: (16, 64)}), [("load", 1, 0, 64)], "tile 1 is not configured"),
    (config({0: (16, 64), 1: (16, 64), 2: (16, 64)}), [("dpbssd", 0, 0, 2)], "must differ"),
    (config({0: (8, 64), 1: (16, 64), 2: (16, 64)}), [("dpbssd", 0, 1, 2)], "dst has 8 rows, a 16"),
    (config({0: (16, 64), 1: (16, 64), 2: (8, 64)}), [("dpbf16ps", 0, 1, 2)], "16 dwords per row, b 8 rows"),
    (config({0: (16, 32), 1: (16, 64), 2: (16, 64)}), [("dpbuud", 0, 1, 2)], "dst has 32 bytes per row"),
    (config({0: (16, 30), 1: (16, 64), 2: (16, 30)}), [("dpbusd", 0, 1, 2)], "multiple of 4"),
]


@pytest.mark.parametrize("cfg,program,message", FAULTS, ids=[f[2] for f in FAULTS])
def test_faults_name_the_instruction_and_the_reason(cfg, program, message):
    with pytest.raises(RuntimeError, match=message):
        run("model", cfg, program)


def test_reserved_bytes_fault():
    cfg = config({0: (16, 64)})
    cfg[5] = 1
    with pytest.raises(RuntimeError, match="LDTILECFG faults: reserved byte 5"):
        run("model", cfg, [])


NEEDS_AMX_MODEL = pytest.mark.skipif(
    "amx-emu" not in SUPPORTED_ISAS, reason="the modelled AMX kernels need AVX-512 with VNNI, BF16 and VBMI"
)


def modelled_counts(method, group: int, m: int, K: int, npanels: int, weights: str = "zero") -> dict:
    """The model's counters over one int8-input kernel call (rows with one scale per row and group
    alike) on zero weights (every scale alike) or random bytes (scales that differ per group)."""
    q = torch.randint(-127, 128, (m, K), dtype=torch.int8)
    scales = torch.ones(m, K // group)
    sums = torch.zeros(m, K // group)
    size = _native.packed_bytes(method, group, 16 * npanels, K)
    if weights == "zero":
        packed = torch.zeros(size, dtype=torch.uint8)
    else:
        packed = torch.randint(
            0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)
        )
    c = torch.empty(m, 16 * npanels)
    _native.amx_model_reset_counters()
    _native.gemm("amx-emu", method, True, m, K, group, q.data_ptr(), scales.data_ptr(), sums.data_ptr(),
                 packed.data_ptr(), npanels, c.data_ptr())  # fmt: skip
    return _native.amx_model_counters()


@NEEDS_AMX_MODEL
@pytest.mark.parametrize("group", [32, 64, 128])
def test_counters_measure_a_kernels_structure(group):
    """The modelled AMX INT8 kernel on 64 rows x 4 panels x K 256: per K-step (64 K-values, 32 in groups
    of 32), per channel pair, per 32-row block, 2 A loads and 4 dot products; the pair's 2 B tiles
    load once per group for every row block when a group is one K-step, else per K-step and block;
    4 tile stores per group and block for the group's fp32 epilogue."""
    m, K, npanels = 64, 256, 4
    counts = modelled_counts(_native.Method.AMXINT8, group, m, K, npanels, weights="random")
    k_step = min(group, 64)
    steps, groups, blocks, pairs = K // k_step, K // group, m // 32, npanels // 2
    assert counts["dots"] == 4 * steps * blocks * pairs
    b_loads = 2 * groups * pairs if group <= 64 else 2 * steps * blocks * pairs
    assert counts["loads"] == 2 * steps * blocks * pairs + b_loads
    assert counts["stores"] == 4 * groups * blocks * pairs
    assert counts["macs"] == m * K * 16 * npanels


@NEEDS_AMX_MODEL
@pytest.mark.parametrize("group", [32, 64, 128])
def test_counters_measure_the_whole_k_int4_kernel(group):
    """The modelled AMX INT4 kernel for rows with one activation scale, 96 rows x 4 panels x K 512:
    per K-step of 64 values, channel pair and 32-row block, 2 A and 2 B loads and 4 dot products (one
    dot product per load, whatever the group), and 4 tile stores per block and pair over all of K."""
    m, K, npanels = 96, 512, 4
    counts = modelled_counts(_native.Method.AMXINT4, group, m, K, npanels)
    steps, blocks, pairs = K // 64, m // 32, npanels // 2
    assert counts["dots"] == 4 * steps * blocks * pairs
    assert counts["loads"] == 4 * steps * blocks * pairs
    assert counts["stores"] == 4 * blocks * pairs
    assert counts["macs"] == m * K * 16 * npanels


@NEEDS_AMX_MODEL
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [16, 32, 96])
def test_counters_measure_the_whole_k_int8_kernel(group, m):
    """The modelled AMX INT8 kernel for rows with one activation scale over weights whose channels
    have one scale over all of K (every group's scales alike), K 512, from 32 rows: per K-step of 64
    values, channel pair and 32-row block, 2 A and 2 B loads and 4 dot products, and 4 tile stores
    per block and pair over all of K, not per group. Below 32 rows the group kernel: its stores per
    group (2 a group and pair for one 16-row A tile)."""
    K, npanels = 512, 4
    counts = modelled_counts(_native.Method.AMXINT8, group, m, K, npanels)
    steps, blocks, pairs = K // 64, -(-m // 32), npanels // 2
    if m < 32:
        assert counts["stores"] == 2 * (K // group) * pairs
        return
    assert counts["dots"] == 4 * steps * blocks * pairs
    assert counts["loads"] == 4 * steps * blocks * pairs
    assert counts["stores"] == 4 * blocks * pairs
    assert counts["macs"] == m * K * 16 * npanels


NEEDS_AMX = pytest.mark.skipif(
    "amx" not in SUPPORTED_ISAS, reason="needs a CPU with AMX-INT8/BF16 and the kernel's permission"
)


@NEEDS_AMX
@pytest.mark.parametrize("op", list(INT8_DOTS))
@pytest.mark.parametrize("m,ka,n", SHAPES)
def test_integer_dot_products_equal_the_tile_unit(op, m, ka, n):
    """The same program on the model and on this CPU's tile unit gives the same bits."""
    results = []
    for backend in ("model", "hardware"):
        a, b, c = random_bytes(16, 11), random_bytes(16, 12), random_bytes(16, 13)
        cfg, prog = dot_program(op, m, ka, n, c, a, b)
        run(backend, cfg, prog)
        results.append(c)
    assert torch.equal(results[0], results[1])


@NEEDS_AMX
@pytest.mark.parametrize("m,ka,n", SHAPES)
def test_bf16_dot_product_is_within_rounding_of_the_tile_unit(m, ka, n):
    """Emerald Rapids does not round after every product as the SDM's pseudocode does (the model):
    over a 16 x 16 x 32 tile, 109 of 256 sums differ, by at most 7.6e-8 of |c| + sum |a b| (the
    closest order tried, all products exact then one rounding before adding c, still differs in 22).
    Denormal inputs and sums are handled alike (DAZ / FTZ)."""
    a, b = random_bf16_rows(16, 11, denormals=True), random_bf16_rows(16, 12, denormals=True)
    c0 = torch.randn(16, 16, generator=torch.Generator().manual_seed(13))
    c0[1, :3] = torch.tensor([1e-39, -2e-40, 7e-45])
    c0 = c0.view(torch.int8).reshape(16, 64).clone()
    results = []
    for backend in ("model", "hardware"):
        c = c0.clone()
        cfg, prog = dot_program("dpbf16ps", m, ka, n, c, a, b)
        run(backend, cfg, prog)
        results.append(c)
    model, hardware = (r[:m].view(torch.float32)[:, : n // 4].double() for r in results)
    A = bf16_daz(a[:m].view(torch.bfloat16)[:, : ka // 2]).double()
    B = bf16_daz(b[: ka // 4].view(torch.bfloat16)[:, : n // 2]).double()
    magnitude = c0[:m].view(torch.float32)[:, : n // 4].double().abs()
    for k in range(ka // 4):
        for e in range(2):
            magnitude += (A[:, 2 * k + e, None] * B[None, k, e::2]).abs()
    assert ((model - hardware).abs() <= 2**-22 * magnitude).all()
    assert torch.equal(results[0][m:], results[1][m:]) and torch.equal(results[0][:m, n:], results[1][:m, n:])


@NEEDS_AMX
def test_denormals_on_the_tile_unit_as_in_the_model():
    """A denormal bf16 input times 2^100 reads as zero; a denormal accumulator is flushed."""
    for a_value, b_value, c_value in [(2.0**-133 * 1.5, 2.0**100, 0.0), (0.0, 0.0, 1e-39), (1.0, 1.0, 1e-39)]:
        out = []
        for backend in ("model", "hardware"):
            a = torch.zeros(16, 32, dtype=torch.bfloat16)
            b = torch.zeros(16, 32, dtype=torch.bfloat16)
            a[0, 0], b[0, 0] = a_value, b_value
            c = torch.zeros(16, 16)
            c[0, 0] = c_value
            c = c.view(torch.int8).reshape(16, 64).clone()
            cfg, prog = dot_program(
                "dpbf16ps",
                16,
                64,
                64,
                c,
                a.view(torch.int8).reshape(16, 64),
                b.view(torch.int8).reshape(16, 64),
            )
            run(backend, cfg, prog)
            out.append(c.view(torch.float32)[0, 0].item())
        assert out[0] == out[1], (a_value, b_value, c_value, out)


@NEEDS_AMX_MODEL
@pytest.mark.parametrize("rows", [32, 64, 96])
def test_int4_layer_sums_all_of_k_in_the_tiles_from_64_rows(rows):
    """A modelled AMX INT4 layer, one expert (hidden 256, intermediate 192, groups of 64): from 64
    rows gate/up and down both run the whole-K kernel (h quantized with one scale per row), 4 tile
    stores per 32-row block and channel pair over all of K; below, the group kernel stores 4 per
    group. Every dot product is an integer one (16 x 16 x 64 multiply-adds): no bf16 path."""
    H, I, group = 256, 192, 64
    gate, up, down = make_weights(1, I, H)
    layer = KTMoEWrapper(0, 1, 1, H, I, None, 1, 1, method="AMXINT4", isa="amx-emu")
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    _native.amx_model_reset_counters()
    layer.forward(make_hidden(rows, H), torch.zeros(rows, 1, dtype=torch.int64), torch.ones(rows, 1))
    counts = _native.amx_model_counters()
    blocks = -(-rows // 32)
    pairs = {"gate/up": 2 * I // 32, "down": H // 32}  # channel pairs of 16-channel panels
    k_groups = {"gate/up": H // group, "down": I // group}
    per_block_and_pair = {name: 4 if rows >= 64 else 4 * k_groups[name] for name in pairs}
    assert counts["stores"] == sum(blocks * pairs[n] * per_block_and_pair[n] for n in pairs)
    assert counts["macs"] == 16 * 16 * 64 * counts["dots"]
