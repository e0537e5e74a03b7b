"""What a checkpoint format declares, and the reading every per-expert format shares.

A format reads a layer's routed experts two ways: as values (bf16/fp16/fp32, or float32 from
dequantized codes) for the methods the engine quantizes to, and as canonical matrices
(``kt_sglang.engine.canonical``) for the methods that take the checkpoint's own values as they are.
The model-level names and shapes (which tensors are expert e's gate of layer l, H and I) come from
the `Checkpoint` it is handed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.engine.methods import Method, MethodInfo
    from kt_sglang.weights.checkpoint import Checkpoint

# Experts come as (gate, up, down): each a [n, N, K] tensor of values, or a list of n canonical
# matrices. A per-expert format reads one linear's canonical matrices from where it located it and
# its [N, K]:
NativeRead = Callable[[str, tuple[int, int]], "CanonicalMatrix"]


class ExpertFormat(ABC):
    """One way checkpoints store a layer's experts.

    ``name`` is what ``MethodInfo.checkpoint_format`` calls the format ("dense" for bf16/fp16/fp32,
    which no method takes as is); ``serves`` says which methods take it as it is: by default those
    whose ``checkpoint_format`` is the name. Two formats share a name where they differ in layout
    (gpt-oss's fused MXFP4 and per-expert MXFP4) or in what only the method's own tensors tell apart
    (FP8's block and per-channel scales).
    """

    name: str = ""
    label: str = ""  # how messages name the layer's experts (default: name)
    # kt-kernel's `convert-cpu --input-type` for these experts (dense: by dtype, see DenseFormat)
    input_type: str | None = None
    # the checkpoint's config states the group size, and a layer built with another is refused
    states_group: bool = False

    def describe(self) -> str:
        return self.label or self.name

    @abstractmethod
    def detect(self, ckpt: Checkpoint, layer: int) -> bool:
        """Whether the layer's experts are stored in this format."""

    def serves(self, info: MethodInfo) -> bool:
        """Whether the method takes this format's values as they are."""
        return info.checkpoint_format == self.name

    def refusal(self, ckpt: Checkpoint, layer: int, method: Method) -> CheckpointError:
        """The error for a method that reads checkpoints as they are, but not this format."""
        from kt_sglang.engine.methods import METHODS

        fits = [m.value for m, i in METHODS.items() if self.serves(i)]
        quantizing = ", ".join(m.value for m, i in METHODS.items() if i.quantizes_dense)
        return CheckpointError(
            f"layer {layer} of {ckpt.path}: {method.value} reads {METHODS[method].checkpoint_format} "
            f"experts, and these are {self.describe()}; use "
            f"{' or '.join(fits) or 'a method that quantizes (' + quantizing + ')'}"
        )

    @abstractmethod
    def stored_dtype(self, ckpt: Checkpoint, layer: int) -> torch.dtype:
        """The dtype the layer's expert weights are stored in (int32 for packed INT4)."""

    def kt_input_type(self, ckpt: Checkpoint, layer: int) -> str | None:
        return self.input_type

    def stated_group(self, ckpt: Checkpoint, layer: int) -> int | None:
        """The group size the checkpoint's config states for the layer's experts (``states_group``)."""
        return None

    @abstractmethod
    def values(self, ckpt: Checkpoint, layer: int, ids: list[int]) -> tuple:
        """gate, up ``[n, I, H]`` and down ``[n, H, I]`` of experts ``ids`` as values."""

    @abstractmethod
    def iter_values(self, ckpt: Checkpoint, layer: int) -> Iterator[tuple]:
        """(gate, up, down) expert by expert."""

    def native(self, ckpt: Checkpoint, layer: int, ids: list[int], method: Method) -> tuple:
        """gate, up, down lists of canonical matrices of experts ``ids``, for ``method``, which takes
        this format as it is; the format checks the config and the method's own requirements. A
        format that no method takes as it is (dense) refuses."""
        raise self.refusal(ckpt, layer, method)

    def iter_native(self, ckpt: Checkpoint, layer: int, method: Method) -> Iterator[tuple]:
        raise self.refusal(ckpt, layer, method)

    def biases(self, ckpt: Checkpoint, layer: int, ids: list[int]) -> tuple:
        """gate, up ``[n, I]`` and down ``[n, H]`` fp32 biases; None where the format has none."""
        return None, None, None


class PerExpertFormat(ExpertFormat):
    """Experts stored one linear (a tensor, or a set of tensors under one name prefix) per expert and
    projection, under the family's names (``configs/models/<family>.json``: ``experts``).

    A format says where one linear is (``locate``), whether what is there is its own (``claims``), and
    how to read it: ``read_values`` for methods that quantize, ``native_reader`` for the method that
    takes it as is.
    """

    def locate(self, ckpt: Checkpoint, pattern: str, layer: int, expert: int) -> str | None:
        """Where the linear ``pattern`` names is stored in this format (a tensor name or a name prefix)."""
        return ckpt.source.resolve(pattern, layer=layer, expert=expert)

    def claims(self, ckpt: Checkpoint, where: str) -> bool:
        """Whether the located linear is stored in this format (its dtype, its scales)."""
        return True

    def stored_name(self, ckpt: Checkpoint, where: str) -> str:
        """The tensor holding the linear's weights."""
        return where

    @abstractmethod
    def read_values(self, ckpt: Checkpoint, where: str, shape: tuple[int, int]) -> torch.Tensor:
        """One linear ``[N, K]`` as values."""

    def native_reader(self, ckpt: Checkpoint, layer: int, method: Method) -> NativeRead:
        """Checks the config for ``method`` once, and returns the reader of one linear; a format that
        no method takes as it is (dense) refuses."""
        raise self.refusal(ckpt, layer, method)

    # --------------------------------------------------------------------------------------------

    def _first(self, ckpt: Checkpoint, layer: int) -> str | None:
        gate = ckpt.family.experts.get("gate")
        return self.locate(ckpt, gate, layer, 0) if gate else None

    def detect(self, ckpt: Checkpoint, layer: int) -> bool:
        where = self._first(ckpt, layer)
        return where is not None and self.claims(ckpt, where)

    def stored_dtype(self, ckpt: Checkpoint, layer: int) -> torch.dtype:
        return ckpt.source.dtype(self.stored_name(ckpt, self._first(ckpt, layer)))

    def _where(self, ckpt: Checkpoint, proj: str, layer: int, expert: int) -> str:
        pattern = ckpt.family.experts[proj]
        where = self.locate(ckpt, pattern, layer, expert)
        if where is None:
            missing = pattern.format(layer=layer, expert=expert)
            raise CheckpointError(f"{self.describe()} tensors of {missing} are missing from {ckpt.path}")
        return where

    def _expert(self, ckpt: Checkpoint, layer: int, expert: int, read) -> tuple:
        return tuple(
            read(self._where(ckpt, proj, layer, expert), shape) for proj, shape in ckpt.projections().items()
        )

    def _values(self, ckpt: Checkpoint, where: str, shape: tuple[int, int]) -> torch.Tensor:
        w = self.read_values(ckpt, where, shape)
        if tuple(w.shape) != shape:
            raise CheckpointError(
                f"{ckpt.source.where(where)} has shape {list(w.shape)}; expected {list(shape)}"
            )
        return w

    def values(self, ckpt: Checkpoint, layer: int, ids: list[int]) -> tuple:
        parts = []
        for proj, shape in ckpt.projections().items():
            mats = [self._values(ckpt, self._where(ckpt, proj, layer, e), shape) for e in ids]
            parts.append(torch.stack(mats) if mats else torch.empty(0, *shape))
        dtypes = {p.dtype for p in parts}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        return tuple(p.to(dtype).contiguous() for p in parts)

    def iter_values(self, ckpt: Checkpoint, layer: int) -> Iterator[tuple]:
        for e in range(ckpt.spec.num_experts):
            yield self._expert(ckpt, layer, e, lambda where, shape: self._values(ckpt, where, shape))

    def native(self, ckpt: Checkpoint, layer: int, ids: list[int], method: Method) -> tuple:
        read = self.native_reader(ckpt, layer, method)
        gate, up, down = [], [], []
        for e in ids:
            for out, m in zip((gate, up, down), self._expert(ckpt, layer, e, read), strict=True):
                out.append(m)
        return gate, up, down

    def iter_native(self, ckpt: Checkpoint, layer: int, method: Method) -> Iterator[tuple]:
        read = self.native_reader(ckpt, layer, method)
        for e in range(ckpt.spec.num_experts):
            yield self._expert(ckpt, layer, e, read)


def dequantized(checkpoint_format: str, m: CanonicalMatrix, K: int, group: int | None = None) -> torch.Tensor:
    """float32 values of canonical matrices read as is, for methods that quantize them again."""
    from kt_sglang.engine.canonical import dequantize
    from kt_sglang.engine.methods import method_for_format

    return dequantize(method_for_format(checkpoint_format), m, K, group)
