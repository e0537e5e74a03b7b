"""Every registered method's GEMMs on every ISA this CPU runs, one kernel call at a time, by property
(as ggml's test-backend-ops): against the scalar twin, and against float32 on the dequantized
weights, at awkward sizes (rows that fill no block, odd panel counts, K of several groups)."""

from __future__ import annotations

import pytest
import torch
from conftest import AMX_ISAS, isa_params

from kt_sglang.engine.canonical import dequantize, quantize, random_canonical
from kt_sglang.engine.methods import METHODS, parse_method
from kt_sglang.engine.native import _native
from kt_sglang.engine.reference import relative_error

# (rows, panels of 16 output channels, K in groups): decode passes (1-8 rows) and prefill tiles
# (the checkpoint formats' decoded tiles past 16 rows: a tile of 4 panels and one of 1, several
# K-chunks), K past FP8's 512-value decode chunks; a K long enough that AMX dequantizes the panels
# of its bf16-input integer kernels in several runs (2, 2 and 1 at 128 groups).
SIZES = [
    (1, 1, 2),
    (3, 5, 1),
    (5, 3, 3),
    (8, 2, 2),
    (13, 7, 1),
    (37, 3, 2),
    (9, 2, 5),
    (20, 5, 9),
    (33, 5, 128),
]

# A kernel against its scalar twin: the same products summed in another order, and the bf16-input
# kernels of the integer methods requantize their inputs to int16 inside the call (~2e-5). AMX
# rounds the dequantized weights of those kernels to bf16 (2^-9 relative).
TWIN_BOUND = {"amx": 4e-3, "amx-emu": 4e-3}
TWIN_BOUND_DEFAULT = 1e-4
# Against float32 on the dequantized weights and the kernel's own inputs (bf16, or int8 times
# their scales): fp32 summation, and the bf16-input kernels of the integer methods requantize
# their inputs to int16 inside the call (~1e-5).
REFERENCE_BOUND = 1e-4


def _cases():
    for method, info in METHODS.items():
        inputs = [False] + ([True] if info.int8_activations or info.int8_h else [])
        for group in info.allowed_groups:
            for int8_input in inputs:
                for m, panels, groups in SIZES:
                    yield pytest.param(
                        method.value,
                        group,
                        int8_input,
                        m,
                        panels,
                        groups,
                        id=f"{method.value}-g{group}-{'q8' if int8_input else 'a16'}"
                        f"-m{m}-p{panels}-k{groups}",
                    )


def _packed(method, group, w):
    """The engine's quantization of `w` [N, K] (random checkpoint values for a method that comes from
    checkpoints only), its dequantized float32 copy, and its packed panels."""
    N, K = w.shape
    if METHODS[parse_method(method)].quantizes_dense:
        canon = quantize(method, w.bfloat16(), group)
    else:
        canon = random_canonical(method, N, K, group, seed=N + K)
    third = next((t for t in (canon.mins, canon.zeros, canon.global_scale) if t is not None), None)
    tensors = [t for t in (canon.weight, canon.scales, third) if t is not None]
    return dequantize(method, canon, K, group), _pack(method, group, N, K, *tensors)


def _inputs(int8_input, m, K, group, seed):
    """Activation rows as the kernel reads them, and their float32 values."""
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(seed))
    if not int8_input:
        x = x.bfloat16()
        return (x, None, None), x.float()
    q = torch.empty(m, K, dtype=torch.int8)
    scales = torch.empty(m, K // group)
    sums = torch.empty(m, K // group)
    _native.quantize_activations(x.data_ptr(), m, K, group, q.data_ptr(), scales.data_ptr(), sums.data_ptr())
    return (q, scales, sums), q.float() * scales.repeat_interleave(group, 1)


def _run(isa, method, int8_input, m, K, group, inputs, packed, npanels):
    rows, scales, sums = inputs
    c = torch.full((-(-m // 32) * 32, 16 * npanels), float("nan"))  # AMX stores whole blocks of 32 rows
    _native.gemm(
        isa,
        getattr(_native.Method, method),
        int8_input,
        m,
        K,
        group,
        rows.data_ptr(),
        scales.data_ptr() if scales is not None else 0,
        sums.data_ptr() if sums is not None else 0,
        packed.data_ptr(),
        npanels,
        c.data_ptr(),
    )
    return c[:m]


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("method,group,int8_input,m,npanels,groups", list(_cases()))
def test_kernel_against_scalar_and_float32(isa, method, group, int8_input, m, npanels, groups):
    K = groups * max(group, 64)
    N = 16 * npanels
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(m + npanels)) / K**0.5
    dense, packed = _packed(method, group, w)
    inputs, x = _inputs(int8_input, m, K, group, seed=m * 7 + groups)
    out = _run(isa, method, int8_input, m, K, group, inputs, packed, npanels)
    assert torch.isfinite(out).all()
    reference = x @ dense.T
    assert relative_error(out, reference) <= REFERENCE_BOUND * (40 if isa in AMX_ISAS else 1)
    if isa != "scalar":
        twin = _run("scalar", method, int8_input, m, K, group, inputs, packed, npanels)
        assert relative_error(out, twin) <= TWIN_BOUND.get(isa, TWIN_BOUND_DEFAULT)


def _int4_per_channel(canon, K, group):
    """AMXINT4 weights as the AMX kernel requantizes them for rows with one activation scale (int8,
    one scale per channel, 16-bit fixed point): the int8 values [N, K] and the channel scales [N]."""
    w = canon.weight
    q = torch.stack([w & 0x0F, w >> 4], dim=-1).reshape(w.shape[0], -1)[:, :K].to(torch.int32)
    ws, wm = canon.scales.float(), canon.mins.float()
    peak = torch.maximum(wm.abs(), (wm + 15 * ws).abs()).amax(1, keepdim=True)
    fixed = torch.where(peak > 0, 32512.0 / peak, torch.zeros_like(peak))
    a = torch.round(ws * fixed).to(torch.int32).repeat_interleave(group, 1)
    b = (torch.round(wm * fixed).to(torch.int32) + 128).repeat_interleave(group, 1)
    q8 = torch.div(q * a + b, 256, rounding_mode="floor").clamp(-128, 127)
    return q8, peak.squeeze(1) / 127


@pytest.mark.parametrize("isa", isa_params(AMX_ISAS))
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m,npanels,groups", [(64, 2, 4), (100, 3, 2), (161, 5, 3)])
def test_int4_rows_with_one_scale_sum_all_of_k(isa, group, m, npanels, groups):
    """AMXINT4 rows quantized with one scale per row (as the layer does) go, from 64 rows, to the AMX
    kernel that requantizes the weights to int8 per channel and sums all of K in the tiles: equal to
    that arithmetic done in torch (the integer sums exact), within 0.012 of float32 on the INT4
    weights (the requantization's own rounding, ~0.008), and per-group scales still take the group
    kernel (equal to the scalar twin)."""
    K = groups * max(group, 64)
    N = 16 * npanels
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(m)) / K**0.5
    canon = quantize("AMXINT4", w.bfloat16(), group)
    dense, packed = _packed("AMXINT4", group, w)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m + 1))
    rows = torch.empty(m, K, dtype=torch.int8)
    scales, sums = torch.empty(m, K // group), torch.empty(m, K // group)
    _native.quantize_activations(
        x.data_ptr(), m, K, group, rows.data_ptr(), scales.data_ptr(), sums.data_ptr(), per_row=True
    )
    assert torch.equal(scales, scales[:, :1].expand_as(scales))
    assert torch.allclose(scales[:, 0], x.abs().amax(1) / 127)
    out = _run(isa, "AMXINT4", True, m, K, group, (rows, scales, sums), packed, npanels)
    q8, channel_scale = _int4_per_channel(canon, K, group)
    exact = (rows.double() @ q8.double().T) * scales[:, :1].double() * channel_scale.double()
    assert relative_error(out, exact.float()) <= 1e-6
    assert relative_error(out, (rows.float() * scales[:, :1]) @ dense.T) <= 0.012
    grouped = _inputs(True, m, K, group, seed=m)[0]
    twin = _run("scalar", "AMXINT4", True, m, K, group, grouped, packed, npanels)
    assert relative_error(_run(isa, "AMXINT4", True, m, K, group, grouped, packed, npanels), twin) <= 4e-3


def _int8_rows_with_one_scale(w, group):
    """AMXINT8 canonical weights with one scale per row over all of K (as kt-kernel quantizes):
    int8 values [N, K], and the fp16 scale in every group's slot [N, K / group]."""
    scale = (w.abs().amax(1, keepdim=True) / 127).half()
    q = torch.round(w / scale.float()).clamp(-127, 127).to(torch.int8)
    return q, scale.expand(-1, w.shape[1] // group).contiguous()


def _pack(method, group, N, K, *tensors):
    """The packed panels of canonical tensors (weight, scales, then mins / zeros / global scale)."""
    packed = torch.zeros(
        _native.packed_bytes(getattr(_native.Method, method), group, N, K), dtype=torch.uint8
    )
    ptrs = [t.data_ptr() for t in tensors] + [0] * (3 - len(tensors))
    _native.pack_matrix(getattr(_native.Method, method), group, N, K, *ptrs, packed.data_ptr())
    return packed


@pytest.mark.parametrize("isa", isa_params(AMX_ISAS))
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m,npanels,groups", [(5, 1, 2), (37, 3, 4), (64, 2, 4), (161, 5, 3)])
def test_int8_rows_with_one_scale_over_weights_with_one_scale_sum_all_of_k(isa, group, m, npanels, groups):
    """AMXINT8 weights whose rows have one scale over all of K (kt-kernel's directories) times rows
    quantized with one scale per row go to the AMX kernel that sums all of K in the tiles: the integer
    sums exact, so equal to that arithmetic in float64 torch within fp32 rounding; rows with per-group
    scales, or weights with per-group scales, still take the group kernel (equal to the scalar twin)."""
    K = groups * max(group, 64)
    N = 16 * npanels
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(m)) / K**0.5
    q, scales = _int8_rows_with_one_scale(w, group)
    packed = _pack("AMXINT8", group, N, K, q, scales)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m + 1))
    rows = torch.empty(m, K, dtype=torch.int8)
    row_scales, sums = torch.empty(m, K // group), torch.empty(m, K // group)
    _native.quantize_activations(
        x.data_ptr(), m, K, group, rows.data_ptr(), row_scales.data_ptr(), sums.data_ptr(), per_row=True
    )
    out = _run(isa, "AMXINT8", True, m, K, group, (rows, row_scales, sums), packed, npanels)
    exact = (rows.double() @ q.double().T) * row_scales[:, :1].double() * scales[:, 0].double()
    assert relative_error(out, exact.float()) <= 1e-6
    twin = _run("scalar", "AMXINT8", True, m, K, group, (rows, row_scales, sums), packed, npanels)
    assert relative_error(out, twin) <= 1e-6
    grouped = _inputs(True, m, K, group, seed=m)[0]
    twin = _run("scalar", "AMXINT8", True, m, K, group, grouped, packed, npanels)
    assert relative_error(_run(isa, "AMXINT8", True, m, K, group, grouped, packed, npanels), twin) <= 1e-5
    _, group_packed = _packed("AMXINT8", group, w)  # per-group weight scales
    twin = _run("scalar", "AMXINT8", True, m, K, group, (rows, row_scales, sums), group_packed, npanels)
    out = _run(isa, "AMXINT8", True, m, K, group, (rows, row_scales, sums), group_packed, npanels)
    assert relative_error(out, twin) <= 1e-5


@pytest.mark.parametrize("method", [m.value for m in METHODS])
def test_zero_padding_past_the_source(method):
    """K not a multiple of the group and N not of 16: packing zero-fills the rest, so a kernel over
    the padded sizes equals the product over the source's."""
    group = next(info for m, info in METHODS.items() if m.value == method).default_group
    N, K = 21, max(group, 64) + 40
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3)) / K**0.5
    dense, packed = _packed(method, group, w)
    Kp, Np = -(-K // max(group, 64)) * max(group, 64), 32
    x = torch.zeros(3, Kp)
    x[:, :K] = torch.randn(3, K, generator=torch.Generator().manual_seed(4))
    x = x.bfloat16()
    out = _run("scalar", method, False, 3, Kp, group, (x, None, None), packed, Np // 16)
    assert relative_error(out[:, :N], x[:, :K].float() @ dense.T) <= REFERENCE_BOUND
    assert torch.count_nonzero(out[:, N:]) == 0
