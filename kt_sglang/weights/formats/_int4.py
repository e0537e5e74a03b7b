"""What the INT4 formats share: each linear is a set of tensors under one name prefix
(``....gate_proj``), 8 nibbles packed in an int32 along K, scales (and zero points) per group of K
whose size the checkpoint's config states. Each becomes its method's canonical tensors
(``kt_sglang.engine.canonical``): the nibbles as bytes with the low nibble at the even k, the scales
(and zeros) per row and group.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.formats.base import PerExpertFormat, dequantized
from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.engine.methods import Method
    from kt_sglang.weights.checkpoint import Checkpoint


@dataclass(frozen=True)
class Int4Scheme:
    group: int
    symmetric: bool
    zeros_stored_minus_one: bool = False  # GPTQ's original format


def config_error(ckpt: Checkpoint, what: str) -> CheckpointError:
    return CheckpointError(f"{ckpt.path / 'config.json'}: quantization_config {what}")


class Int4Format(PerExpertFormat):
    """A subclass names its packed weight tensor (``packed``), reads its scheme from the config and
    one linear from its tensors."""

    input_type = "int4"
    states_group = True
    packed: str  # the name suffix of the packed weight tensor

    @abstractmethod
    def scheme(self, ckpt: Checkpoint, module: str) -> Int4Scheme:
        """The checkpoint's quantization scheme for ``module`` (a linear's name), from its config;
        raises naming what does not fit the method."""

    @abstractmethod
    def read_matrix(
        self, ckpt: Checkpoint, base: str, scheme: Int4Scheme, shape: tuple[int, int]
    ) -> CanonicalMatrix:
        """One linear ``[N, K]`` as the method's canonical tensors, values unchanged."""

    # --------------------------------------------------------------------------------------------

    def locate(self, ckpt: Checkpoint, pattern: str, layer: int, expert: int) -> str | None:
        suffix = "." + self.packed
        name = ckpt.source.resolve(pattern.removesuffix(".weight") + suffix, layer=layer, expert=expert)
        return None if name is None else name.removesuffix(suffix)

    def stored_name(self, ckpt: Checkpoint, where: str) -> str:
        return f"{where}.{self.packed}"

    def stated_group(self, ckpt: Checkpoint, layer: int) -> int | None:
        return self.scheme(ckpt, self._first(ckpt, layer)).group

    def read_values(self, ckpt: Checkpoint, where: str, shape: tuple[int, int]) -> torch.Tensor:
        scheme = self.scheme(ckpt, where)
        return dequantized(self.name, self.read_matrix(ckpt, where, scheme, shape), shape[1], scheme.group)

    def native_reader(self, ckpt: Checkpoint, layer: int, method: Method):
        scheme = self.scheme(ckpt, self._first(ckpt, layer))
        return lambda base, shape: self.read_matrix(ckpt, base, scheme, shape)

    def group(self, ckpt: Checkpoint, group, module: str) -> int:
        """The config's group size, if the method reading this format has kernels for it."""
        from kt_sglang.engine.methods import METHODS, method_for_format

        method = method_for_format(self.name)
        allowed = METHODS[method].allowed_groups
        if group is None:
            raise config_error(ckpt, f"states no group_size for {module}")
        if int(group) not in allowed:
            raise config_error(
                ckpt,
                f"has group_size {group} for {module}; {method.value} reads groups of "
                f"{', '.join(map(str, allowed))}",
            )
        return int(group)

    def tensor(
        self,
        ckpt: Checkpoint,
        base: str,
        suffix: str,
        dtypes: tuple[torch.dtype, ...],
        expected: tuple[int, ...],
        what: str,
    ) -> torch.Tensor:
        """``{base}.{suffix}``, checked to be one of ``dtypes`` and of shape ``expected``."""
        name = f"{base}.{suffix}"
        if not ckpt.source.has(name):
            raise CheckpointError(f"tensor {name} is missing from {ckpt.path} ({self.name} checkpoint)")
        t = ckpt.source.tensor(name)
        if t.dtype not in dtypes or tuple(t.shape) != expected:
            want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(
                f"{ckpt.source.where(name)} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}; "
                f"expected {want} {list(expected)} ({what})"
            )
        return t


def check_finite(ckpt: Checkpoint, name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"scales {ckpt.source.where(name)} hold NaN or infinite values")
