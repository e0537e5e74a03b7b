"""Float32 reference MoE: the independent oracle for tests, benchmarks and the demo."""

from __future__ import annotations

import torch


def moe_reference(
    hidden: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    skip_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j w[t, j] * down_e(silu(gate_e x) * up_e x)`` over each token's experts, in float32.

    hidden ``[T, H]``; gate, up ``[E, I, H]``; down ``[E, H, I]``; topk_ids ``[T, k]`` (-1 skips);
    topk_weights ``[T, k]``; skip_mask ``[E]`` (True = expert not counted). Returns ``[T, H]`` fp32.
    """
    x = hidden.float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    ids = topk_ids.long()
    for e in ids.unique().tolist():
        if e < 0 or (skip_mask is not None and bool(skip_mask[e])):
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        h = torch.nn.functional.silu(xe @ gate[e].float().T) * (xe @ up[e].float().T)
        out.index_add_(0, tok, (h @ down[e].float().T) * topk_weights[tok, slot].float()[:, None])
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ||actual - expected|| / ||expected||."""
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30))
