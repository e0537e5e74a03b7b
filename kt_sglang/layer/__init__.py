"""The hybrid MoE layer: hot experts on the GPU (or the CPU device), cold ones on the CPU engine."""

from __future__ import annotations

from kt_sglang.layer.hybrid import DeferralChain, HybridMoELayer
from kt_sglang.layer.prefill import GpuPrefill

__all__ = ["DeferralChain", "GpuPrefill", "HybridMoELayer"]
