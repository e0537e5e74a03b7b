"""Expert weights: readers of Hugging Face checkpoints (tensor names per family in configs/models)."""

from __future__ import annotations

from kt_sglang.weights.checkpoint import Checkpoint, CheckpointError, open_checkpoint
from kt_sglang.weights.families import ModelFamily, family_for, load_families

__all__ = ["Checkpoint", "CheckpointError", "open_checkpoint", "ModelFamily", "family_for", "load_families"]
