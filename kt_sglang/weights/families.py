"""Model families: config keys and expert tensor names, read from configs/models/*.json (data, not code)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

# The orientations a fused expert tensor is stored in (E experts, H hidden size, I intermediate size):
# first [out, in] per expert as nn.Linear keeps it (used as x @ w^T), then transposed (used as x @ w).
FUSED_LAYOUTS = {"gate_up": ("[E, 2I, H]", "[E, H, 2I]"), "down": ("[E, H, I]", "[E, I, H]")}


@dataclass(frozen=True)
class ModelFamily:
    family: str
    model_types: tuple[str, ...]
    config: dict[str, tuple[str, ...]]  # our name -> config keys to try, in order
    moe_layers: dict[str, str]  # rule -> config key
    experts: dict[str, str]  # gate / up / down -> name pattern with {layer} and {expert}
    fused_experts: dict[str, str]  # gate_up / down -> name pattern with {layer}
    fused_layout: dict[str, str]  # gate_up / down -> one of FUSED_LAYOUTS: shapes cannot tell when H == 2I
    # MXFP4 experts fused per layer as gpt-oss ships them: gate_up / down -> name prefix with {layer}
    # of `_blocks`, `_scales` and `_bias`; gate_up_rows "interleaved" (gate = even rows) or "halves".
    fused_mxfp4: dict[str, str]
    # The experts' activation (kt_sglang.engine.activation.Glu): kind, and limit / alpha as numbers
    # or config keys (one, or several tried in order) with defaults ({"key": ..., "default": ...});
    # empty: silu.
    activation: dict

    def glu(self, config: dict):
        """The activation this family's experts use, with the values of ``config``."""
        from kt_sglang.engine.activation import SILU, Glu

        if not self.activation:
            return SILU

        def value(spec, default):
            if isinstance(spec, dict):
                keys = spec["key"] if isinstance(spec["key"], list) else [spec["key"]]
                found = next((config[k] for k in keys if config.get(k) is not None), None)
                return float(spec.get("default", default) if found is None else found)
            return float(default if spec is None else spec)

        a = self.activation
        return Glu(a.get("kind", "silu"), value(a.get("limit"), 0.0), value(a.get("alpha"), 1.702))

    def fused_transposed(self, proj: str) -> bool:
        return self.fused_layout[proj] == FUSED_LAYOUTS[proj][1]

    def config_value(self, config: dict, name: str):
        for key in self.config[name]:
            if config.get(key) is not None:
                return config[key]
        raise KeyError(f"config.json has none of {list(self.config[name])} (needed for {name})")

    def is_moe_layer(self, config: dict, layer: int) -> bool:
        rules = self.moe_layers
        if "first_k_dense_replace" in rules and layer < int(config.get(rules["first_k_dense_replace"]) or 0):
            return False
        if "every" in rules and layer % int(config.get(rules["every"]) or 1) != 0:
            return False
        if "mlp_only_layers" in rules and layer in (config.get(rules["mlp_only_layers"]) or []):
            return False
        if "sparse_step" in rules and (layer + 1) % int(config.get(rules["sparse_step"]) or 1) != 0:
            return False
        return True


def _configs_dir() -> Path:
    installed = Path(__file__).resolve().parent.parent / "configs" / "models"  # wheel: kt_sglang/configs
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "configs" / "models"  # source checkout


@functools.cache
def load_families() -> tuple[ModelFamily, ...]:
    families = []
    for path in sorted(_configs_dir().glob("*.json")):
        data = json.loads(path.read_text())
        fused, layout = dict(data.get("fused_experts", {})), dict(data.get("fused_layout", {}))
        if set(layout) != set(fused) or any(layout[k] not in FUSED_LAYOUTS.get(k, ()) for k in layout):
            allowed = "; ".join(f"{k}: {' or '.join(v)}" for k, v in FUSED_LAYOUTS.items())
            raise RuntimeError(
                f"{path}: fused_layout must name the layout of each fused_experts tensor ({allowed}); "
                f"found {layout}"
            )
        families.append(
            ModelFamily(
                family=data["family"],
                model_types=tuple(data["model_types"]),
                config={k: tuple(v) for k, v in data["config"].items()},
                moe_layers=dict(data.get("moe_layers", {})),
                experts=dict(data["experts"]),
                fused_experts=fused,
                fused_layout=layout,
                fused_mxfp4=dict(data.get("fused_mxfp4", {})),
                activation=dict(data.get("activation", {})),
            )
        )
    if not families:
        raise RuntimeError(f"no model family files in {_configs_dir()}")
    return tuple(families)


def family_for(model_type: str) -> ModelFamily:
    for family in load_families():
        if model_type in family.model_types:
            return family
    known = sorted(t for f in load_families() for t in f.model_types)
    raise ValueError(f"model_type {model_type!r} is not a supported MoE family; supported: {known}")
