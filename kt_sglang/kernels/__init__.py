"""Routing split and hot-expert MoE (torch versions here; Triton versions for CUDA come next)."""

from __future__ import annotations

from kt_sglang.kernels.hot_moe import hot_moe_torch
from kt_sglang.kernels.split import RoutingSplit, split_routing_torch

__all__ = ["RoutingSplit", "hot_moe_torch", "split_routing_torch"]
