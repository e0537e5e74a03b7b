"""GPTQ INT4: per linear ``qweight`` int32 ``[K/8, N]`` (8 nibbles along K), ``scales`` fp16
``[K/g, N]``, ``qzeros`` int32 ``[K/g, N/8]`` (8 nibbles along N; the original "gptq" format stores
zero - 1, "gptq_v2" the zero itself), ``g_idx`` int32 ``[K]`` (groups in order only:
``desc_act=false``). Read as is by GPTQ_INT4.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kt_sglang.weights.formats._int4 import Int4Format, Int4Scheme, check_finite, config_error
from kt_sglang.weights.source import CheckpointError

if TYPE_CHECKING:
    from kt_sglang.engine.canonical import CanonicalMatrix
    from kt_sglang.weights.checkpoint import Checkpoint


class GptqFormat(Int4Format):
    name = "gptq"
    packed = "qweight"

    def scheme(self, ckpt: Checkpoint, module: str) -> Int4Scheme:
        q = ckpt.quantization
        if q.get("quant_method") != "gptq":
            raise config_error(
                ckpt, f"has quant_method {q.get('quant_method')!r}; {module} holds GPTQ's qweight"
            )
        if q.get("bits") != 4:
            raise config_error(ckpt, f"has bits {q.get('bits')}; GPTQ_INT4 reads 4-bit GPTQ")
        version = q.get("checkpoint_format", "gptq")
        if version not in ("gptq", "gptq_v2"):
            raise config_error(
                ckpt, f"has checkpoint_format {version!r}; GPTQ_INT4 reads 'gptq' and 'gptq_v2'"
            )
        group = self.group(ckpt, q.get("group_size"), module)
        return Int4Scheme(group, bool(q.get("sym", True)), version == "gptq")

    def read_matrix(
        self, ckpt: Checkpoint, base: str, scheme: Int4Scheme, shape: tuple[int, int]
    ) -> CanonicalMatrix:
        from kt_sglang.engine.canonical import CanonicalMatrix

        N, K = shape
        g = scheme.group
        groups = -(-K // g)
        what = f"a [{N}, {K}] weight, groups of {g}"
        if K % 8 or N % 8:
            raise CheckpointError(f"{base}: [{N}, {K}] is not a multiple of 8 in both sizes, as GPTQ packs")
        qweight = self.tensor(ckpt, base, "qweight", (torch.int32,), (K // 8, N), what)
        scales = self.tensor(ckpt, base, "scales", (torch.float16,), (groups, N), what)
        qzeros = self.tensor(ckpt, base, "qzeros", (torch.int32,), (groups, N // 8), what)
        if ckpt.source.has(base + ".g_idx"):
            g_idx = self.tensor(ckpt, base, "g_idx", (torch.int32, torch.int64), (K,), what)
            if not torch.equal(g_idx.long(), torch.arange(K) // g):
                raise CheckpointError(
                    f"{ckpt.source.where(base + '.g_idx')} permutes the groups (GPTQ act-order, "
                    "desc_act=true); GPTQ_INT4 reads checkpoints quantized with desc_act=false only"
                )
        check_finite(ckpt, base + ".scales", scales)
        weight = qweight.contiguous().view(torch.uint8).reshape(K // 8, N, 4).permute(1, 0, 2)
        zeros = _nibbles(qzeros).reshape(groups, N)
        if scheme.zeros_stored_minus_one:
            zeros = zeros + 1
        return CanonicalMatrix(
            weight.reshape(N, K // 2).contiguous(), scales.t().contiguous(), zeros=zeros.t().contiguous()
        )


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., n]`` -> uint8 ``[..., 8 n]``, the least significant nibble first."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


GPTQ = GptqFormat()
