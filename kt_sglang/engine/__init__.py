"""Python facade over the native CPU expert engine."""

from __future__ import annotations

from kt_sglang.engine.activation import Glu
from kt_sglang.engine.config import MoEConfig, SFTConfig
from kt_sglang.engine.inference import InferenceMoEWrapper
from kt_sglang.engine.methods import METHODS, Method, parse_method
from kt_sglang.engine.pools import PoolLayout, SharedRunner, plan_pools, selected_isa
from kt_sglang.engine.sft import SFTMoEWrapper
from kt_sglang.engine.wrapper import KTMoEWrapper

__all__ = [
    "Glu",
    "InferenceMoEWrapper",
    "KTMoEWrapper",
    "METHODS",
    "Method",
    "MoEConfig",
    "PoolLayout",
    "SFTConfig",
    "SFTMoEWrapper",
    "SharedRunner",
    "parse_method",
    "plan_pools",
    "selected_isa",
]
