"""Routing split and hot-expert MoE: Triton kernels for CUDA tensors, torch twins for the rest."""

from __future__ import annotations

from kt_sglang.kernels.hot_moe import hot_moe, hot_moe_torch
from kt_sglang.kernels.split import RoutingSplit, split_routing, split_routing_torch

__all__ = ["RoutingSplit", "hot_moe", "hot_moe_torch", "split_routing", "split_routing_torch"]
