"""Canonical quantization (native) against torch re-implementations of the format."""

from __future__ import annotations

import pytest
import torch

from kt_sglang.engine.native import _native


def quantize(method: str, w: torch.Tensor, group: int):
    N, K = w.shape
    G = -(-K // group)
    if method == "AMXINT8":
        q = torch.empty(N, K, dtype=torch.int8)
    else:
        q = torch.empty(N, (K + 1) // 2, dtype=torch.uint8)
    scales = torch.empty(N, G, dtype=torch.float16)
    mins = torch.empty(N, G, dtype=torch.float16)
    src = w.contiguous()
    dtype = {
        torch.float32: _native.DType.float32,
        torch.bfloat16: _native.DType.bfloat16,
        torch.float16: _native.DType.float16,
    }[src.dtype]
    _native.quantize_matrix(
        getattr(_native.Method, method),
        group,
        src.data_ptr(),
        dtype,
        N,
        K,
        q.data_ptr(),
        scales.data_ptr(),
        mins.data_ptr(),
    )
    return q, scales, mins


def unpack_int4(q: torch.Tensor, K: int) -> torch.Tensor:
    lo, hi = q & 0x0F, q >> 4
    return torch.stack([lo, hi], -1).reshape(q.shape[0], -1)[:, :K].float()


def per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] -> [N, G, group] with the partial last group zero-padded."""
    N, K = x.shape
    G = -(-K // group)
    return torch.nn.functional.pad(x, (0, G * group - K)).view(N, G, group)


@pytest.mark.parametrize("group,K", [(32, 256), (64, 320), (128, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_matches_definition(group, K, dtype):
    w = (torch.randn(24, K) * 0.05).to(dtype)
    q, scales, _ = quantize("AMXINT8", w, group)
    wf = w.float()
    expected_scales = (per_group(wf, group).abs().amax(-1) / 127).half()
    assert torch.equal(scales, expected_scales)
    s = scales.float().repeat_interleave(group, 1)[:, :K]
    expected_q = torch.clamp(torch.round(wf / s), -127, 127).to(torch.int8)
    assert (q.int() - expected_q.int()).abs().max() <= 1  # ties may round either way after fp16
    assert (q.float() * s - wf).abs().max() <= (s / 2).max() * 1.01


@pytest.mark.parametrize("group,K", [(32, 256), (64, 320), (128, 100)])
def test_int4_layout_and_search(group, K):
    w = torch.randn(16, K) * 0.03
    q, scales, mins = quantize("AMXINT4", w, group)
    s = scales.float().repeat_interleave(group, 1)[:, :K]
    m = mins.float().repeat_interleave(group, 1)[:, :K]
    deq = unpack_int4(q, K) * s + m
    err = per_group(deq - w, group).pow(2).sum(-1)
    # The search starts from plain min/max: it can only do better, group by group.
    lo = per_group(w, group).amin(-1).half().float()
    hi = per_group(w, group).amax(-1)
    step = ((hi - per_group(w, group).amin(-1)) / 15).half().float()
    base = torch.clamp(torch.round((per_group(w, group) - lo[..., None]) / step[..., None]), 0, 15)
    base_err = base * step[..., None] + lo[..., None] - per_group(w, group)
    if K % group:  # padding columns are not part of the matrix
        base_err[:, -1, K % group :] = 0
    base_err = base_err.pow(2).sum(-1)
    assert torch.all(err <= base_err * 1.0001 + 1e-12)
    assert float(per_group(deq - w, group).norm() / w.norm()) < 0.095


def test_constant_and_zero_groups():
    w = torch.zeros(4, 64)
    w[1] = 0.25
    q8, s8, _ = quantize("AMXINT8", w, 32)
    assert torch.all(q8[0] == 0) and torch.all(s8[0] == 0)
    q4, s4, m4 = quantize("AMXINT4", w, 32)
    deq = unpack_int4(q4, 64) * s4.float().repeat_interleave(32, 1) + m4.float().repeat_interleave(32, 1)
    assert torch.allclose(deq, w)


@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "AMXINT4"])
def test_canonical_load_equals_quantize_on_load(method):
    """The packing entry point for pre-quantized weights gives exactly the same engine output."""
    from conftest import make_hidden, make_routing, make_weights

    from kt_sglang import KTMoEWrapper
    from kt_sglang.engine.canonical import quantize

    E, k, H, I, T = 6, 2, 320, 200, 40
    gate, up, down = (t.bfloat16() for t in make_weights(E, I, H, seed=11))
    ids, weights = make_routing(T, E, k)
    x = make_hidden(T, H)
    direct = KTMoEWrapper(0, E, k, H, I, None, 2, 1, method=method)
    direct.load_weights_from_tensors(gate, up, down)
    canonical = KTMoEWrapper(1, E, k, H, I, None, 2, 1, method=method)
    canonical.load_canonical(
        [quantize(method, g) for g in gate],
        [quantize(method, u) for u in up],
        [quantize(method, d) for d in down],
    )
    assert torch.equal(direct.forward(x, ids, weights), canonical.forward(x, ids, weights))


def test_canonical_load_validates():
    from kt_sglang import KTMoEWrapper
    from kt_sglang.engine.canonical import CanonicalMatrix, quantize

    E, k, H, I = 2, 1, 128, 64
    layer = KTMoEWrapper(0, E, k, H, I, None, 1, 1, method="AMXINT4")
    good = [quantize("AMXINT4", torch.randn(I, H)) for _ in range(E)]
    down = [quantize("AMXINT4", torch.randn(H, I)) for _ in range(E)]
    with pytest.raises(ValueError, match="gate has 1 matrices; num_experts is 2"):
        layer.load_canonical(good[:1], good, down)
    bad = [quantize("AMXINT4", torch.randn(I, H), group_size=32) for _ in range(E)]
    with pytest.raises(
        ValueError, match=r"up\[0\].scales is torch.float16 \[64, 4\]; expected torch.float16 \[64, 2\]"
    ):
        layer.load_canonical(good, bad, down)
    with pytest.raises(ValueError, match=r"down\[1\].mins is missing"):
        layer.load_canonical(good, good, [down[0], CanonicalMatrix(down[1].weight, down[1].scales)])
    with pytest.raises(ValueError, match=r"down\[1\].weight is torch.int8 \[128, 64\]; expected torch.uint8"):
        layer.load_canonical(good, good, [down[0], quantize("AMXINT8", torch.randn(H, I))])


def test_native_quantizer_validates_before_writing():
    w = torch.randn(4, 64)
    out = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.zeros(4, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="group size 256 is not allowed for AMXINT4"):
        _native.quantize_matrix(
            _native.Method.AMXINT4,
            256,
            w.data_ptr(),
            _native.DType.float32,
            4,
            64,
            out.data_ptr(),
            scales.data_ptr(),
            scales.data_ptr(),
        )
    with pytest.raises(ValueError, match="null source or destination"):
        _native.quantize_matrix(
            _native.Method.AMXINT8, 64, w.data_ptr(), _native.DType.float32, 4, 64, 0, 0, 0
        )
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("method", ["FP8", "FP8_PERCHANNEL"])
@pytest.mark.parametrize("N,K", [(128, 256), (200, 333), (1, 130)])
def test_fp8_quantization_matches_torch_e4m3_cast(method, N, K):
    """amax / 448 scales per 128 x 128 block (FP8) or per row (FP8_PERCHANNEL), values rounded to
    e4m3 to nearest even: the same bytes as torch's float8_e4m3fn cast of w * (448 / amax)."""
    from kt_sglang.engine.canonical import quantize as quantize_canonical

    gen = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=gen) * torch.logspace(-3, 2, K)  # several binades, some subnormal
    w[0, :3] = torch.tensor([0.0, -0.0, 1e-30])
    m = quantize_canonical(method, w)
    rows = 1 if method == "FP8_PERCHANNEL" else 128
    cols = K if method == "FP8_PERCHANNEL" else 128
    expected = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for r0 in range(0, N, rows):
        for c0 in range(0, K, cols):
            block = w[r0 : r0 + rows, c0 : c0 + cols]
            amax = block.abs().max()
            scale = m.scales[r0] if method == "FP8_PERCHANNEL" else m.scales[r0 // 128, c0 // 128]
            assert scale.item() == (amax / 448.0).item()
            inv = 448.0 / amax if amax > 0 else torch.tensor(0.0)
            expected[r0 : r0 + rows, c0 : c0 + cols] = (block * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(m.weight.view(torch.uint8), expected.view(torch.uint8))
