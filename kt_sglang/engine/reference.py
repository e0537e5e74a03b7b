"""Float32 reference MoE: the independent oracle for tests, benchmarks and the demo."""

from __future__ import annotations

import torch

from kt_sglang.engine.activation import SILU, Glu


def moe_reference(
    hidden: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    skip_mask: torch.Tensor | None = None,
    activation: Glu = SILU,
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None),
) -> torch.Tensor:
    """``sum_j w[t, j] * (down_e act(gate_e x + bg_e, up_e x + bu_e) + bd_e)`` over each token's
    experts, in float32 (act: silu(g) * u unless ``activation`` says otherwise).

    hidden ``[T, H]``; gate, up ``[E, I, H]``; down ``[E, H, I]``; topk_ids ``[T, k]`` (-1 skips);
    topk_weights ``[T, k]``; skip_mask ``[E]`` (True = expert not counted); biases: gate, up
    ``[E, I]``, down ``[E, H]``, each optional. Returns ``[T, H]`` fp32.
    """
    gate_bias, up_bias, down_bias = biases
    x = hidden.float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    ids = topk_ids.long()
    for e in ids.unique().tolist():
        if e < 0 or (skip_mask is not None and bool(skip_mask[e])):
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        g, u = xe @ gate[e].float().T, xe @ up[e].float().T
        if gate_bias is not None:
            g = g + gate_bias[e].float()
        if up_bias is not None:
            u = u + up_bias[e].float()
        y = activation(g, u) @ down[e].float().T
        if down_bias is not None:
            y = y + down_bias[e].float()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ||actual - expected|| / ||expected||."""
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30))
