"""What the FP8 formats share: float8_e4m3fn weights ``[N, K]``, each with a scale tensor beside it,
``{name}_scale_inv`` (DeepSeek-V3's naming, always blocks) or ``{name}_scale`` (compressed-tensors'
naming for blocks and channels alike: its shape tells). The scales are fp32, bf16 or fp16 and are
read unchanged in value (bf16/fp16 become the same fp32 numbers).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.formats.base import PerExpertFormat
from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.methods import Method, MethodInfo
    from kt_sglang.weights.checkpoint import Checkpoint

# How messages name the scales an FP8 method reads, by their shape rule (TensorSpec.shape).
_METHOD_SCALES = {"N/group,K/group": "block", "N": "per-channel"}

# Block size of FP8 checkpoints that do not say (DeepSeek-V3, Qwen3-FP8, MiniMax-M2 all use 128 x 128).
DEFAULT_BLOCK = 128


def is_float8(dtype: torch.dtype) -> bool:
    """Any 8-bit float (e4m3fn, e4m3fnuz, e5m2, ...): the checkpoint ships FP8 experts."""
    return dtype.is_floating_point and dtype.itemsize == 1


def config_block(ckpt: Checkpoint) -> tuple[int, int]:
    block = ckpt.quantization.get("weight_block_size") or [DEFAULT_BLOCK, DEFAULT_BLOCK]
    return int(block[0]), int(block[1])


def has_block_scales(ckpt: Checkpoint, name: str) -> bool:
    """Whether the FP8 weight ``name`` has block scales: a ``_scale_inv``, or a ``_scale`` of the
    config's block shape (not ``[N, 1]``, which is one scale per channel)."""
    src, channel = ckpt.source, name + "_scale"
    if src.has(name + "_scale_inv"):
        return True
    if not src.has(channel) or len(src.shape(name)) != 2:
        return False
    (N, K), (bn, bk) = src.shape(name), config_block(ckpt)
    return src.shape(channel) == (-(-N // bn), -(-K // bk)) != (N, 1)


class Fp8Format(PerExpertFormat):
    """Per-expert e4m3 weights with one kind of scales; a subclass says which (``block_scales``),
    how it checks and expands them, and which methods read them (their ``scales`` tensor's shape)."""

    name = "fp8"
    input_type = "fp8"
    block_scales: bool
    what: str  # how messages name this kind of scales
    method_scales: str  # the shape rule (TensorSpec.shape) of the scales of the methods that read it

    def claims(self, ckpt: Checkpoint, where: str) -> bool:
        return is_float8(ckpt.source.dtype(where)) and has_block_scales(ckpt, where) == self.block_scales

    def serves(self, info: MethodInfo) -> bool:
        return (
            info.checkpoint_format == self.name
            and len(info.tensors) > 1
            and info.tensors[1].shape == self.method_scales
        )

    def refusal(self, ckpt: Checkpoint, layer: int, method: Method) -> CheckpointError:
        from kt_sglang.engine.methods import METHODS

        info = METHODS[method]
        if info.checkpoint_format != self.name:
            return super().refusal(ckpt, layer, method)
        name = self._first(ckpt, layer)  # the method reads FP8 with the other kind of scales
        scale = self.scale_name(ckpt, name, ckpt.source.tensor(name))
        fits = [m.value for m, i in METHODS.items() if self.serves(i)]
        return CheckpointError(
            f"{ckpt.source.where(name)} is FP8 with {self.what} ({scale}); {method.value} needs "
            f"{_METHOD_SCALES[info.tensors[1].shape]} scales: use "
            f"{' or '.join(fits) or 'a method that quantizes'} for this checkpoint"
        )

    # what each kind does ------------------------------------------------------------------------

    def check_config(self, ckpt: Checkpoint, method: Method, block: int) -> None:
        """Refuses a config whose scales the method does not read as they are."""

    @abstractmethod
    def layout(self, scale: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> torch.Tensor | None:
        """The scales as fp32 in this kind's layout; None when their shape is not this kind's."""

    @abstractmethod
    def expected(self, N: int, K: int, block: tuple[int, int]) -> str:
        """This kind's shape of the scales of a ``[N, K]`` weight, and what one scale covers."""

    @abstractmethod
    def expand(self, scales: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> torch.Tensor:
        """One scale per weight ``[N, K]``."""

    # what they share ----------------------------------------------------------------------------

    def scale_name(self, ckpt: Checkpoint, name: str, w: torch.Tensor) -> str:
        """The scales of an FP8 weight, after checking the weight is e4m3fn and 2-D."""
        src = ckpt.source
        if w.dtype != torch.float8_e4m3fn:
            raise CheckpointError(
                f"tensor {src.where(name)} has dtype {w.dtype}; FP8 weights must be float8_e4m3fn "
                "(e4m3fnuz and e5m2 are not read as they are: convert the checkpoint to float8_e4m3fn "
                "or bf16 first)"
            )
        if w.dim() != 2:
            raise CheckpointError(f"tensor {src.where(name)} has shape {list(w.shape)}; expected 2-D")
        inv, channel = name + "_scale_inv", name + "_scale"
        for scale in (inv, channel):
            if src.has(scale):
                return scale
        raise CheckpointError(
            f"tensor {name} is FP8 but {inv} is missing, and so is a per-channel {channel} "
            f"(the weight is in {src.shard(name).name}, {ckpt.path})"
        )

    def scales(self, ckpt: Checkpoint, name: str, w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
        """The weight's scales as fp32, unchanged in value, in this kind's layout."""
        scale_name = self.scale_name(ckpt, name, w)
        scale, where = ckpt.source.tensor(scale_name), ckpt.source.where(scale_name)
        if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(
                f"scales {where} have dtype {scale.dtype}; expected float32, bfloat16 or float16"
            )
        N, K = w.shape
        scales = self.layout(scale, N, K, block)
        if scales is None:
            raise CheckpointError(
                f"scales {where} have shape {list(scale.shape)}; expected {self.expected(N, K, block)} "
                f"of the [{N}, {K}] weight {name})"
            )
        if not bool(torch.isfinite(scales).all()):
            raise CheckpointError(f"scales {where} hold NaN or infinite values")
        return scales

    def read_values(self, ckpt: Checkpoint, where: str, shape: tuple[int, int]) -> torch.Tensor:
        w, block = ckpt.source.tensor(where), config_block(ckpt)
        scales = self.scales(ckpt, where, w, block)
        return (w.float() * self.expand(scales, *w.shape, block)).bfloat16()

    def native_reader(self, ckpt: Checkpoint, layer: int, method: Method):
        from kt_sglang.engine.canonical import CanonicalMatrix
        from kt_sglang.engine.methods import METHODS

        block = METHODS[method].default_group
        self.check_config(ckpt, method, block)

        def read(name: str, shape: tuple[int, int]) -> CanonicalMatrix:
            w = ckpt.source.tensor(name)
            if tuple(w.shape) != shape:
                raise CheckpointError(
                    f"{ckpt.source.where(name)} has shape {list(w.shape)}; expected {list(shape)}"
                )
            return CanonicalMatrix(w, self.scales(ckpt, name, w, (block, block)))

        return read
