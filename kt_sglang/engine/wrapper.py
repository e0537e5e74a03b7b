"""KTMoEWrapper: kt-kernel's entry point to one MoE layer's CPU experts, call-compatible with it.

``KTMoEWrapper(...)`` builds the inference layer (engine/inference.py) and
``KTMoEWrapper(..., mode="sft")`` the fine-tuning one (engine/sft.py), from kt-kernel's arguments
(`MoEConfig`'s fields; `SFTConfig`'s with ``mode="sft"``). A caller holding a configuration builds
the layer's class from it directly: ``InferenceMoEWrapper(config)``, ``SFTMoEWrapper(config)``.
"""

from __future__ import annotations

import abc

from kt_sglang.engine.base import BaseMoEWrapper
from kt_sglang.engine.config import MoEConfig, SFTConfig
from kt_sglang.engine.inference import InferenceMoEWrapper
from kt_sglang.engine.sft import SFTMoEWrapper

# mode -> (its configuration, its layer)
MODES: dict[str, tuple[type[MoEConfig], type[BaseMoEWrapper]]] = {
    "inference": (MoEConfig, InferenceMoEWrapper),
    "sft": (SFTConfig, SFTMoEWrapper),
}


class KTMoEWrapper(abc.ABC):  # noqa: B024  a virtual base: no method of its own to make abstract
    """The CPU experts of one MoE layer (see the module's docstring). Either mode's layer is an
    instance of this class (a registered virtual subclass); the batch-size buffers' static API is
    kt-kernel's."""

    def __new__(cls, *args, mode: str = "inference", **kwargs) -> BaseMoEWrapper:
        if mode not in MODES:
            supported = ", ".join(repr(m) for m in MODES)
            raise ValueError(f"Unknown mode: {mode!r}. Supported modes: {supported}")
        config_class, layer_class = MODES[mode]
        return layer_class(config_class(*args, **kwargs))

    set_capture_batch_sizes = staticmethod(InferenceMoEWrapper.set_capture_batch_sizes)
    get_capture_batch_sizes = staticmethod(InferenceMoEWrapper.get_capture_batch_sizes)
    clear_buffer_cache = staticmethod(InferenceMoEWrapper.clear_buffer_cache)


KTMoEWrapper.register(BaseMoEWrapper)
