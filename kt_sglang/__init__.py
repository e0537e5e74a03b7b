"""kt-sglang: SGLang Mixture-of-Experts serving with cold experts on a NUMA-aware CPU engine."""

from __future__ import annotations

__version__ = "0.1.0"

from kt_sglang.engine import KTMoEWrapper  # noqa: E402
from kt_sglang.weights import sources  # noqa: E402,F401  the weight sources register with the engine

__all__ = ["KTMoEWrapper", "__version__"]
