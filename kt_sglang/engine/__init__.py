"""Python facade over the native CPU expert engine."""

from __future__ import annotations

from kt_sglang.engine.activation import Glu
from kt_sglang.engine.methods import METHODS, Method, parse_method
from kt_sglang.engine.pools import PoolLayout, SharedRunner, plan_pools, selected_isa
from kt_sglang.engine.wrapper import KTMoEWrapper

# KTMoEWrapper(mode="sft") builds the fine-tuning layer, which registers itself on import.
from kt_sglang.engine import sft  # noqa: E402, F401  isort: skip

__all__ = [
    "Glu",
    "KTMoEWrapper",
    "METHODS",
    "Method",
    "PoolLayout",
    "SharedRunner",
    "parse_method",
    "plan_pools",
    "selected_isa",
]
