"""The hot experts' MoE in plain torch: the CPU-device path and the reference of the Triton kernel."""

from __future__ import annotations

import torch


def hot_moe_torch(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``sum_j w[t, j] * w2_s(silu(gate_s x) * up_s x)`` over selections with slot s >= 0, in fp32.

    hidden ``[T, H]``; w13 ``[S, 2I, H]`` (gate rows, then up rows); w2 ``[S, H, I]``; slot_ids and
    weights ``[T, k]``. Returns fp32 ``[T, H]``.
    """
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    inter = w2.shape[2]
    for s in slot_ids[slot_ids >= 0].unique().tolist():
        tok, j = (slot_ids == s).nonzero(as_tuple=True)
        gate_up = hidden[tok].float() @ w13[s].float().T
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tok, (h @ w2[s].float().T) * weights[tok, j, None].float())
    return out
