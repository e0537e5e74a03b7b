"""Which experts of each MoE layer are hot (GPU slots); routing statistics that drive `frequency`."""

from kt_sglang.placement.stats import PlacementStats, StatsRecorder
from kt_sglang.placement.strategies import STRATEGIES, plan_hot_experts, slot_map

__all__ = ["STRATEGIES", "PlacementStats", "StatsRecorder", "plan_hot_experts", "slot_map"]
