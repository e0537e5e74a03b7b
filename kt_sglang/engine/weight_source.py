"""Where a layer's expert weights come from: what the layer needs from a source, and the one function
that tells which source a path is.

A `WeightSource` answers for its files: the model's shape, the experts' activation, the methods and
groups a layer's projections are stored in, and reading the held slots' experts into a layer. The
sources themselves live in ``kt_sglang.weights.sources`` (one module each) and register with
`register_source`; `open_source` is the only code that looks at a path to decide what it is. Each
source claims the paths that are its own, by their markers; where two claim a path, one must name
the other in ``supersedes`` (a converted directory may carry the model's config.json), else the path
is refused: no answer depends on the order the sources were registered in.

A new source subclasses `WeightSource` in a module of ``kt_sglang/weights/sources/``: ``describes``,
``claims`` (and ``supersedes``), ``shape``, ``verify`` and ``load``, what it records (``recorded_method``,
``recorded_group``, ``activation``) or refuses (``check_method``, ``check_adapter``), and
``layer_methods`` where its files decide a layer's methods; ``@register_source`` on the class, and
the module's name in ``kt_sglang/weights/sources/__init__.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from kt_sglang.engine.activation import SILU, Glu
from kt_sglang.engine.methods import FILE_METHODS, Method

if TYPE_CHECKING:
    import torch

    from kt_sglang.engine.base import BaseMoEWrapper
    from kt_sglang.engine.config import MoEConfig


class WeightSourceError(ValueError):
    """The weights at a path cannot serve the layer; the message names the file, tensor or flag."""


@dataclass(frozen=True)
class ModelShape:
    """The model a source's experts belong to, as the source records it."""

    num_experts: int
    hidden_size: int
    intermediate_size: int  # of one routed expert
    moe_layers: tuple[int, ...]
    where: str  # the file these facts come from, for messages

    def sizes(self) -> tuple[int, int, int]:
        """(experts, hidden, intermediate): what two sources of one model agree on."""
        return self.num_experts, self.hidden_size, self.intermediate_size


@dataclass(frozen=True)
class LayerMethods:
    """The engine methods and groups one layer's projections are stored in."""

    method: Method  # gate and up
    group_size: int | None  # the source's (None: none recorded); a group_size the layer is given comes first
    down_method: Method | None = None  # None: the same as gate/up
    down_group_size: int | None = None
    # Int8 inputs with one scale per token (gate/up) and per row of h (down): weights with one scale
    # per row over all of K computed with the numerics they were made for (kt-kernel's), summing all
    # of K on AMX.
    int8_input_per_row: bool = False


class WeightSource(ABC):
    """The expert weights at ``path``, as one kind of source stores them.

    A subclass declares what it looks for (``describes``, e.g. "GGUF models (a .gguf file ...)"),
    which of the methods that take each layer's method from a file it serves (``file_methods``), and
    decides from a path's markers whether the path is its own (``claims``). It is built per layer and
    cheaply: files are read when a question needs them.
    """

    describes: ClassVar[str]
    file_methods: ClassVar[tuple[str, ...]] = ()
    # the sources whose claim this one's overrides where both claim a path
    supersedes: ClassVar[tuple[type[WeightSource], ...]] = ()

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    @abstractmethod
    def claims(cls, path: Path) -> bool:
        """Whether ``path`` (which exists) is this source's, from its name and markers alone."""

    @abstractmethod
    def shape(self) -> ModelShape:
        """The model's shape as the source records it."""

    def activation(self) -> Glu:
        """The experts' activation (plain SiLU where the source records none)."""
        return SILU

    def recorded_method(self) -> str | None:
        """The method the source was written for, which stands when none is given; None: any."""
        return None

    def recorded_group(self, method: Method) -> int | None:
        """The group the source stores ``method``'s experts in, when it records one."""
        return None

    def check_method(self, method: str | Method, flag: str = "method") -> None:
        """Refuses a method that cannot read this source, naming it as ``flag`` (``--kt-method`` for
        the launcher). Here: a method that takes each layer's method from another kind of file."""
        name = method.value if isinstance(method, Method) else str(method).upper()
        if name in FILE_METHODS and name not in self.file_methods:
            readers = " or ".join(s.describes for s in _SOURCES if name in s.file_methods)
            raise WeightSourceError(f"{self.path}: {flag} {name} reads {readers}, and this is none")

    def check_adapter(self) -> None:
        """Refuses an expert adapter (merged into dense weights on load) where the source has no dense
        weights. Here: none is refused (the load merges it, or names the method that cannot)."""
        return None

    def layer_methods(self, config: MoEConfig) -> LayerMethods:
        """The methods and groups of the layer ``config`` describes: by default the method asked
        for, in the group the source records for it."""
        self.check_method(config.file_method or config.method)
        return LayerMethods(config.method, self.recorded_group(config.method))

    @abstractmethod
    def verify(self, method: str, model: ModelShape) -> None:
        """The launcher's check before any worker starts: ``method`` (a ``--kt-method`` value) reads
        the source, every file it needs opens, and its layers fit ``model`` (--model-path's). Messages
        name the launcher's flags."""

    @abstractmethod
    def load(self, layer: BaseMoEWrapper, physical_to_logical_map: torch.Tensor | list[int] | None) -> None:
        """Reads the experts of ``layer``'s held slots into it, slot e taking the source's expert
        ``physical_to_logical_map[e]`` (identity by default)."""


_SOURCES: list[type[WeightSource]] = []


def register_source(source: type[WeightSource]) -> type[WeightSource]:
    """Class decorator of a source module: ``source`` takes part in `open_source`."""
    if source in _SOURCES:
        raise ValueError(f"{source.__name__} is registered as a weight source twice")
    _SOURCES.append(source)
    return source


def open_source(path: str | Path) -> WeightSource:
    """The source the weights at ``path`` are: the one registered source that claims it."""
    path = Path(path)
    if not path.exists():
        raise WeightSourceError(f"{path} does not exist")
    claimed = [s for s in _SOURCES if s.claims(path)]
    claimed = [s for s in claimed if not any(s in other.supersedes for other in claimed)]
    if len(claimed) == 1:
        return claimed[0](path)
    kinds = "; ".join(s.describes for s in (claimed or _SOURCES))
    if claimed:
        raise WeightSourceError(
            f"{path} holds more than one kind of weights ({kinds}): point the weight path at one of them"
        )
    if not path.is_dir():
        raise WeightSourceError(f"{path} is not a directory, nor a file kt-sglang reads ({kinds})")
    raise WeightSourceError(f"{path} holds none of the weights kt-sglang reads ({kinds})")
