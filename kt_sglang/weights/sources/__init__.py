"""The weight sources a layer reads its experts from, one module each: each declares the paths it
claims and answers the questions of ``kt_sglang.engine.weight_source.WeightSource`` for them, and
registers itself there (``@register_source``). A new source is a module here and its name below.

Imported by ``kt_sglang/__init__.py`` after the engine, so every layer finds them registered.
"""

from __future__ import annotations

from kt_sglang.weights.sources import converted, gguf, hf_checkpoint, kt_kernel

__all__ = ["converted", "gguf", "hf_checkpoint", "kt_kernel"]
