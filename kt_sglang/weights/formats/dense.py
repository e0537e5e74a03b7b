"""bf16 / fp16 / fp32 experts, which the engine quantizes to the method the layer uses (no method
takes them as they are), in two layouts:

- per expert: one ``[N, K]`` tensor per expert and projection, under the family's ``experts`` names;
- fused per layer: ``gate_up`` and ``down`` tensors of all the layer's experts, under the family's
  ``fused_experts`` names, in the orientation its ``fused_layout`` declares (the shape alone cannot
  tell the two apart when ``hidden_size == 2 * moe_intermediate_size``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.formats.base import ExpertFormat, PerExpertFormat
from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.weights.checkpoint import Checkpoint

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
# kt-kernel's `convert-cpu --input-type` by stored dtype (fp32 has none)
_INPUT_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class DenseFormat(PerExpertFormat):
    """Claims whatever per-expert ``.weight`` no format before it in the registry did, and names a
    dtype it does not read."""

    name = "dense"

    def kt_input_type(self, ckpt: Checkpoint, layer: int) -> str | None:
        return _INPUT_TYPES.get(self.stored_dtype(ckpt, layer))

    def read_values(self, ckpt: Checkpoint, where: str, shape: tuple[int, int]) -> torch.Tensor:
        w = ckpt.source.tensor(where)
        if w.dtype not in _FLOATS:
            raise CheckpointError(
                f"tensor {ckpt.source.where(where)} has dtype {w.dtype}; expected bf16, fp16, fp32 "
                "or fp8 e4m3"
            )
        return w


class FusedDenseFormat(ExpertFormat):
    name = "dense"
    label = "fused dense"

    def kt_input_type(self, ckpt: Checkpoint, layer: int) -> str | None:
        return _INPUT_TYPES.get(self.stored_dtype(ckpt, layer))

    def _names(self, ckpt: Checkpoint, layer: int) -> dict[str, str | None]:
        return {k: ckpt.source.resolve(p, layer=layer) for k, p in ckpt.family.fused_experts.items()}

    def detect(self, ckpt: Checkpoint, layer: int) -> bool:
        names = self._names(ckpt, layer)
        return bool(names) and all(names.values())

    def stored_dtype(self, ckpt: Checkpoint, layer: int) -> torch.dtype:
        return ckpt.source.dtype(self._names(ckpt, layer)["gate_up"])

    def values(self, ckpt: Checkpoint, layer: int, ids: list[int]) -> tuple:
        names, I, H = self._names(ckpt, layer), ckpt.spec.intermediate_size, ckpt.spec.hidden_size
        gate_up = _fused_stack(ckpt, names["gate_up"], "gate_up", 2 * I, H, ids)
        down = _fused_stack(ckpt, names["down"], "down", H, I, ids)
        return gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous(), down.contiguous()

    def iter_values(self, ckpt: Checkpoint, layer: int):
        yield from zip(*self.values(ckpt, layer, list(range(ckpt.spec.num_experts))), strict=True)


def _fused_stack(ckpt: Checkpoint, name: str, proj: str, out: int, inp: int, ids: list[int]) -> torch.Tensor:
    """Experts ``ids`` of a fused expert tensor as ``[n, out, in]``, read in the orientation its
    family declares. Only their rows are read: a loader that takes a layer a few experts at a time
    never holds the whole tensor."""
    fam, E, src = ckpt.family, ckpt.spec.num_experts, ckpt.source
    rows = src.rows(name)
    shape, dtype = list(rows.get_shape()), rows.get_dtype()
    if dtype not in ("BF16", "F16", "F32"):
        raise CheckpointError(
            f"fused expert tensor {src.where(name)} has dtype {dtype}; expected bf16, fp16 or fp32"
        )
    transposed = fam.fused_transposed(proj)
    expected = [E, inp, out] if transposed else [E, out, inp]
    if shape != expected:
        other = " (the other orientation)" if shape == [E, *expected[:0:-1]] else ""
        raise CheckpointError(
            f"fused expert tensor {src.where(name)} has shape {shape}{other}; expected "
            f"{expected} ({fam.fused_layout[proj]}: the layout configs/models/{fam.family}.json "
            f"declares for model_type {ckpt.config.get('model_type')!r}; E, H, I from config.json)"
        )
    runs, start = [], 0  # contiguous runs of ids, one read each
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append(rows[ids[start] : ids[i - 1] + 1])
            start = i
    w = torch.cat(runs) if runs else torch.empty(0, *expected[1:], dtype=torch.bfloat16)
    return w.transpose(1, 2) if transposed else w


DENSE = DenseFormat()
FUSED_DENSE = FusedDenseFormat()
