"""The gated activation between an expert's gate/up and down projections (the engine's GluConfig,
native/include/kt/moe_layer.h), and its float32 form for references."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The engine's GluKind, in its order.
GLU_KINDS = ("silu", "swiglu_oai")


@dataclass(frozen=True)
class Glu:
    """``silu``: h = silu(g) * u (Qwen, DeepSeek, Mixtral, ...); ``swiglu_oai``: h = (u + 1) * g *
    sigmoid(alpha * g) (gpt-oss). With ``limit`` > 0, g = min(g, limit) and u = clamp(u, -limit,
    limit) first (gpt-oss: 7, DeepSeek-V4: 10)."""

    kind: str = "silu"
    limit: float = 0.0
    alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.kind not in GLU_KINDS:
            raise ValueError(f"activation kind {self.kind!r}: use one of {', '.join(GLU_KINDS)}")
        if not (math.isfinite(self.limit) and self.limit >= 0):
            raise ValueError(f"activation limit {self.limit!r}: use a finite value >= 0 (0: no clamp)")
        if not math.isfinite(self.alpha):
            raise ValueError(f"activation alpha {self.alpha!r} is not finite")

    @property
    def native_kind(self) -> int:
        return GLU_KINDS.index(self.kind)

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The activation in float32 (the references' and the tests')."""
        g, u = g.float(), u.float()
        if self.limit > 0:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        if self.kind == "silu":
            return torch.nn.functional.silu(g) * u
        return (u + 1) * g * torch.sigmoid(self.alpha * g)


SILU = Glu()
