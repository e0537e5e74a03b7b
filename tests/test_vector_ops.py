"""The element-wise kernels around the GEMMs (silu * up to bf16, weighted accumulation, the sum of
the pools' partial outputs into bf16) on every ISA path, against torch."""

from __future__ import annotations

import pytest
import torch
from conftest import AMX_ISAS, isa_params

from kt_sglang.engine.native import _native

ALL = isa_params()


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between two bf16 tensors of the same sign pattern."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("isa", ALL)
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 64, 129])
def test_silu_mul_matches_torch(isa, n):
    g = torch.Generator().manual_seed(n)
    gate = torch.randn(n, generator=g) * 6
    up = torch.randn(n, generator=g)
    h = torch.empty(n, dtype=torch.bfloat16)
    _native.silu_mul(isa, gate.data_ptr(), up.data_ptr(), n, h.data_ptr())
    expected = (torch.nn.functional.silu(gate.double()) * up.double()).bfloat16()
    # exp to ~1e-7 relative: at most one bf16 step off, where the exact value sits near a tie
    assert bf16_ulps(h, expected).max().item() <= 1


@pytest.mark.parametrize("isa", ALL)
def test_silu_mul_extremes(isa):
    gate = torch.tensor(
        [-1e30, -200.0, -88.0, -87.5, -20.0, 0.0, 20.0, 87.5, 88.0, 200.0, 1e30, float("nan")]
    )
    up = torch.full_like(gate, 1.5)
    h = torch.empty(gate.numel(), dtype=torch.bfloat16)
    _native.silu_mul(isa, gate.data_ptr(), up.data_ptr(), gate.numel(), h.data_ptr())
    expected = (torch.nn.functional.silu(gate.double()) * 1.5).bfloat16()
    finite = ~torch.isnan(expected)
    assert torch.allclose(h[finite].float(), expected[finite].float(), rtol=1e-2, atol=1e-30)
    assert torch.isnan(h[-1]).item()


@pytest.mark.parametrize("isa", ALL)
@pytest.mark.parametrize("n", [1, 9, 16, 33, 512])
def test_add_weighted_matches_torch(isa, n):
    g = torch.Generator().manual_seed(n)
    y, c = torch.randn(n, generator=g), torch.randn(n, generator=g)
    expected = y.double() + 0.37 * c.double()
    _native.add_weighted(isa, y.data_ptr(), c.data_ptr(), 0.37, n)
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("isa", ALL)
@pytest.mark.parametrize("n", [1, 7, 8, 17, 129])
@pytest.mark.parametrize("nparts", [1, 3])
@pytest.mark.parametrize("accumulate", [False, True])
def test_sum_to_bf16_matches_torch(isa, n, nparts, accumulate):
    """The pools' partial sums into the bf16 output: the same float32 additions in the same order
    as torch, then round to nearest even, so the result must match bit for bit."""
    g = torch.Generator().manual_seed(n + 10 * nparts)
    parts = [torch.randn(n, generator=g) * 100 for _ in range(nparts)]
    prior = torch.randn(n, generator=g).bfloat16()
    out = prior.clone()
    _native.sum_to_bf16(isa, [p.data_ptr() for p in parts], n, accumulate, out.data_ptr())
    expected = prior.float() if accumulate else torch.zeros(n)
    for p in parts:
        expected = expected + p
    assert torch.equal(out, expected.bfloat16())


@pytest.mark.parametrize("isa", ALL)
def test_element_wise_family_follows_the_path(isa):
    # AMX adds nothing to element-wise work: its table takes the AVX-512 versions
    expected = "avx512" if isa in AMX_ISAS else isa
    assert _native.kernel_families(isa)["SiLU and weighted accumulation"] == expected
