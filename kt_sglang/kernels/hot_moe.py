"""The hot experts' MoE in plain torch: the CPU-device path and the reference of the Triton kernel."""

from __future__ import annotations

import torch


def hot_moe_torch(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``sum_j w[t, j] * w2_s(silu(gate_s x) * up_s x)`` over selections with slot s >= 0.

    hidden ``[T, H]``; w13 ``[S, 2I, H]`` (gate rows, then up rows); w2 ``[S, H, I]``; slot_ids and
    weights ``[T, k]``. The GEMMs run in the weights' dtype (fp32 accumulation, as the GPU kernels
    do; converting weights to fp32 per call made decode ~20x slower), SiLU and the sum in fp32.
    Returns fp32 ``[T, H]``.
    """
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    inter = w2.shape[2]
    for s in slot_ids[slot_ids >= 0].unique().tolist():
        tok, j = (slot_ids == s).nonzero(as_tuple=True)
        gate_up = torch.nn.functional.linear(hidden[tok].to(w13.dtype), w13[s]).float()
        h = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(w2.dtype)
        out.index_add_(0, tok, torch.nn.functional.linear(h, w2[s]).float() * weights[tok, j, None].float())
    return out
