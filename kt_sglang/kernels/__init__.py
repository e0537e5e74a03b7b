"""Routing split and hot-expert MoE: Triton kernels for CUDA tensors, torch twins for the rest.

The Triton modules are imported on first use with CUDA tensors (they import the twins' modules for
their shared types; the twins never import them).
"""

from __future__ import annotations

import torch

from kt_sglang.kernels.hot_moe import hot_moe_torch
from kt_sglang.kernels.split import RoutingSplit, split_routing_torch

__all__ = ["RoutingSplit", "hot_moe", "hot_moe_torch", "split_routing", "split_routing_torch"]


def split_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, gpu_slot_of: torch.Tensor, max_deferred: int
) -> RoutingSplit:
    """Hot, cold-now and deferred selections (`split_routing_torch`); the Triton kernel on CUDA."""
    if topk_ids.is_cuda:
        from kt_sglang.kernels.split_triton import split_routing_triton

        return split_routing_triton(topk_ids, topk_weights, gpu_slot_of, max_deferred)
    return split_routing_torch(topk_ids, topk_weights, gpu_slot_of, max_deferred)


def hot_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The hot experts' fp32 MoE output (`hot_moe_torch`); the Triton kernels on CUDA."""
    if hidden.is_cuda:
        from kt_sglang.kernels.hot_moe_triton import hot_moe_triton

        return hot_moe_triton(hidden, w13, w2, slot_ids, weights)
    return hot_moe_torch(hidden, w13, w2, slot_ids, weights)
