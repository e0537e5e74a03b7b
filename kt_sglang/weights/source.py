"""Opening the safetensors files of a checkpoint or a converted directory, and the error a file that
does not hold what the model needs raises.

A file that cannot be opened is named with the reason the OS gives (missing, permission denied, a
directory) before safetensors is asked: its own error for an unreadable file says "No such file or
directory" whatever the cause.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint does not hold what the model needs; the message names file and tensor."""


def unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read, in words; None when it can."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except FileNotFoundError:
        return "it is missing"
    except IsADirectoryError:
        return "it is a directory"
    except PermissionError:
        st = path.stat()
        return (
            f"permission denied (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}; "
            f"this process runs as uid {os.geteuid()})"
        )
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def open_safetensors(path: Path, advice: str = ""):
    """safetensors' handle of ``path``; a CheckpointError saying why it cannot be read, then
    ``advice`` (e.g. "convert again")."""
    tail = f": {advice}" if advice else ""
    reason = unreadable(path)
    if reason is not None:
        raise CheckpointError(f"cannot read {path}: {reason}{tail}")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for truncated files
        raise CheckpointError(f"cannot read {path} (truncated or not safetensors: {exc}){tail}") from None
