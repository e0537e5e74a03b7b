"""Which experts of each MoE layer are hot (GPU slots); routing statistics that drive `frequency`;
placement by heat, which moves experts while serving."""

from kt_sglang.placement.heat import (
    ExpertHeat,
    ExpertSlots,
    HeatConfig,
    HeatConfigError,
    HeatPlacement,
    choose_moves,
    place_by_heat,
)
from kt_sglang.placement.stats import PlacementStats, StatsRecorder
from kt_sglang.placement.strategies import STRATEGIES, plan_hot_experts, slot_map

__all__ = [
    "STRATEGIES",
    "ExpertHeat",
    "ExpertSlots",
    "HeatConfig",
    "HeatConfigError",
    "HeatPlacement",
    "PlacementStats",
    "StatsRecorder",
    "choose_moves",
    "place_by_heat",
    "plan_hot_experts",
    "slot_map",
]
