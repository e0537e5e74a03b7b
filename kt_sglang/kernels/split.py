"""Split each token's selected experts into hot (GPU slot), cold now, and cold deferred.

Deferral is per token: of a token's cold selections, the ``max_deferred`` with the lowest router
weight (ties: the earlier slot first) are deferred; hot experts are never deferred. The router's
tensors are not modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutingSplit:
    hot_ids: torch.Tensor  # [T, k] GPU slot of each hot selection, -1 elsewhere
    cold_ids: torch.Tensor  # [T, k] expert id of each cold selection computed now, -1 elsewhere
    deferred_ids: torch.Tensor  # [T, k] expert id of each deferred cold selection, -1 elsewhere


def split_routing_torch(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, gpu_slot_of: torch.Tensor, max_deferred: int
) -> RoutingSplit:
    """topk_ids ``[T, k]`` (-1 = none), topk_weights ``[T, k]``, gpu_slot_of ``[E]`` (-1 = cold)."""
    ids = topk_ids.long()
    valid = ids >= 0
    slot = torch.where(valid, gpu_slot_of.to(ids.device)[ids.clamp_min(0)], -1)
    hot = valid & (slot >= 0)
    cold = valid & ~hot
    k = ids.shape[1]
    if max_deferred > 0 and k > 0:
        key = torch.where(cold, topk_weights.float(), torch.inf)
        order = torch.sort(key, dim=1, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(k, device=ids.device).expand_as(order))
        deferred = cold & (rank < max_deferred)
    else:
        deferred = torch.zeros_like(cold)
    none = torch.full_like(ids, -1)
    return RoutingSplit(
        hot_ids=torch.where(hot, slot, none),
        cold_ids=torch.where(cold & ~deferred, ids, none),
        deferred_ids=torch.where(deferred, ids, none),
    )
