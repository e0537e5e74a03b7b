"""Shared helpers: ISA parametrization, weights, routing."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter, which must be chosen before
    # anything imports triton (its own jit helpers are decorated at import).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kt_sglang.engine import SharedRunner
from kt_sglang.engine.native import _native

# amx-emu: the AMX kernels on the software model of the tile unit (native/src/kernels/amx/tile_model.h),
# run wherever the AVX-512 the rest of those kernels uses is present.
ALL_ISAS = ("scalar", "avx2", "avx512", "amx", "amx-emu")
AMX_ISAS = ("amx", "amx-emu")
SUPPORTED_ISAS = tuple(_native.supported_isas())


def isa_params(isas=ALL_ISAS):
    """One pytest param per ISA path; those this CPU lacks are skipped, naming the hardware."""
    return [
        pytest.param(
            isa,
            marks=pytest.mark.skipif(
                isa not in SUPPORTED_ISAS, reason=f"this CPU cannot run the {isa} kernels"
            ),
            id=isa,
        )
        for isa in isas
    ]


@pytest.fixture(autouse=True)
def fresh_runner():
    """Each test may start pools of its own size."""
    SharedRunner.reset()
    yield
    SharedRunner.reset()


def make_weights(E: int, I: int, H: int, seed: int = 0, outliers: int = 0):
    """Expert weights drawn N(0, 1/fan_in), float32; `outliers` entries per row scaled by 20."""
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, I, H, generator=gen) / H**0.5
    up = torch.randn(E, I, H, generator=gen) / H**0.5
    down = torch.randn(E, H, I, generator=gen) / I**0.5
    if outliers:
        for w in (gate, up, down):
            rows = w.reshape(-1, w.shape[-1])
            cols = torch.randint(0, rows.shape[1], (rows.shape[0], outliers), generator=gen)
            rows.scatter_(1, cols, rows.gather(1, cols) * 20)
    return gate, up, down


def make_routing(T: int, E: int, k: int, seed: int = 1, skip_fraction: float = 0.0):
    """Distinct experts per token, softmax weights; a fraction of the slots set to -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = (
        torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        if T
        else torch.zeros(0, k, dtype=torch.int64)
    )
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1)
    if skip_fraction:
        ids[torch.rand(T, k, generator=gen) < skip_fraction] = -1
    return ids, weights


def make_hidden(T: int, H: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).bfloat16()
