"""The engine's packed expert weights decoded in torch, on whatever device holds the bytes.

The packed layout (native/include/kt/quant_types.h) is the same for every ISA: a matrix ``W [N, K]``
is stored as panels of 16 output channels, each panel all of K in groups of ``group`` K-values, each
group its weights in VNNI order followed by its scale block. A pool's slice of one expert holds its
gate/up as interleaved blocks of ``gate_up_block`` channels (that many gate rows' panels, then as
many up rows') over the padded hidden size, and its down projection as panels over the hidden size
(rounded to 16) and the slice's intermediate channels. The GPU prefill (kt_sglang/layer/prefill.py)
copies these bytes to the GPU as they are: no second host copy in another layout, no repacking per
pass. On CUDA the packed kernels (packed_moe_triton.py) compute from them directly, decoding as these
functions do; these functions serve the CPU device, layouts those kernels do not cover, and tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kt_sglang.engine.methods import METHODS, Method

PANEL = 16  # output channels per panel (kPanelWidth)

# float4 e2m1 codes (MXFP4, NVFP4): sign, two exponent bits, one mantissa bit.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def group_bytes(method: Method, group: int) -> int:
    """Bytes of one panel's group: its 16 x group weights, then its scale block."""
    info = METHODS[method]
    return PANEL * group * info.weight_bits // 8 + PANEL * info.scale_bytes + info.scale_extra_bytes


def panel_bytes(method: Method, group: int, K: int) -> int:
    return K // group * group_bytes(method, group)


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw [..., n]`` uint8 reinterpreted as ``dtype`` along its last axis."""
    return raw.contiguous().view(dtype)


def _weights(method: Method, raw: torch.Tensor, group: int) -> torch.Tensor:
    """A group's weight bytes ``[..., W]`` -> the stored values ``[..., 16, group]`` as float32 (codes,
    not yet scaled): BF16/FP8 hold pairs of K-values per channel row, the others int8-style rows of 4."""
    bits = METHODS[method].weight_bits
    lead = raw.shape[:-1]
    if bits == 16:  # BF16: row r holds W[n][2r], W[n][2r + 1]
        w = _bytes_as(raw, torch.bfloat16).reshape(*lead, group // 2, PANEL, 2)
        return w.movedim(-2, -3).reshape(*lead, PANEL, group).float()
    if method in (Method.FP8, Method.FP8_PERCHANNEL):
        # BF16's order at a byte a weight, rows 2q and 2q + 1 in one 64-byte chunk with their 8-byte
        # pieces interleaved (src/methods/fp8/fp8.h, packed_offset): [piece, row parity, byte]
        chunks = raw.reshape(*lead, group // 4, 4, 2, 8).movedim(-2, -3)
        w = _bytes_as(chunks.reshape(*lead, group // 2, 32), torch.float8_e4m3fn).reshape(
            *lead, group // 2, PANEL, 2
        )
        return w.movedim(-2, -3).reshape(*lead, PANEL, group).float()
    if bits == 8:  # INT8: row r holds W[n][4r..4r+3] + 128
        q = raw.reshape(*lead, group // 4, PANEL, 4)
    else:  # 4-bit: byte row r's low nibbles are int8-row r, its high nibbles int8-row r + group / 8
        b = raw.reshape(*lead, group // 8, PANEL, 4)
        q = torch.cat([b & 15, b >> 4], dim=-3)
    w = q.movedim(-2, -3).reshape(*lead, PANEL, group)
    if METHODS[method].weight_codes == "e2m1":
        return torch.tensor(_E2M1, device=raw.device)[w.long()]
    return w.float()


def _scaled(method: Method, codes: torch.Tensor, scale_block: torch.Tensor) -> torch.Tensor:
    """``codes [..., 16, group]`` times the group's scale block ``[..., S]`` (per channel)."""

    def per_channel(dtype: torch.dtype, index: int) -> torch.Tensor:
        size = torch.empty(0, dtype=dtype).element_size()
        part = scale_block[..., index * PANEL * size : (index + 1) * PANEL * size]
        return _bytes_as(part, dtype).float().unsqueeze(-1)  # [..., 16, 1]

    if method == Method.BF16:
        return codes
    if method == Method.AMXINT8:
        return per_channel(torch.float16, 0) * (codes - 128)
    if method == Method.AMXINT4:
        return per_channel(torch.float16, 0) * codes + per_channel(torch.float16, 1)
    if method in (Method.FP8, Method.FP8_PERCHANNEL):
        return per_channel(torch.float32, 0) * codes
    if method == Method.RAWINT4:
        return per_channel(torch.bfloat16, 0) * (codes - METHODS[method].weight_zero)
    if method == Method.GPTQ_INT4:  # stored: scale, then -zero
        return per_channel(torch.float16, 0) * (codes + per_channel(torch.float16, 1))
    if method == Method.MXFP4:
        exponent = per_channel(torch.uint8, 0)
        return torch.exp2(exponent - 127) * codes
    if method == Method.NVFP4:  # e4m3 scale per channel, then the matrix's fp32 global scale
        global_scale = _bytes_as(scale_block[..., PANEL : PANEL + 4], torch.float32).float()
        return per_channel(torch.float8_e4m3fn, 0) * global_scale.unsqueeze(-1) * codes
    raise ValueError(f"no packed decoder for {method.value}")


def decode_panels(method: Method, group: int, raw: torch.Tensor, panels: int, K: int) -> torch.Tensor:
    """``raw [..., panels * panel_bytes]`` uint8 -> float32 ``[..., panels * 16, K]``."""
    gb = group_bytes(method, group)
    weight_bytes = PANEL * group * METHODS[method].weight_bits // 8
    lead = raw.shape[:-1]
    g = raw.reshape(*lead, panels, K // group, gb)
    w = _scaled(method, _weights(method, g[..., :weight_bytes], group), g[..., weight_bytes:])
    # [..., panels, groups, 16, group] -> [..., panels, 16, groups, group]
    return w.movedim(-2, -3).reshape(*lead, panels * PANEL, K)


@dataclass(frozen=True)
class PackedPool:
    """One pool's slice of a layer's packed experts: intermediate channels [i_begin, i_end)."""

    i_begin: int
    i_end: int
    gate_up_bytes: int  # per expert
    down_bytes: int


@dataclass(frozen=True)
class PackedLayout:
    """What it takes to decode a layer's packed experts (``InferenceMoEWrapper.packed_layout``)."""

    method: Method
    group: int
    down_method: Method
    down_group: int
    hidden: int
    intermediate: int
    hidden_padded: int
    gate_up_block: int
    pools: tuple[PackedPool, ...]

    def expert_bytes(self) -> int:
        return sum(p.gate_up_bytes + p.down_bytes for p in self.pools)

    def check(self) -> None:
        """The byte counts the engine reports agree with the layout (a changed packing fails here)."""
        hp = -(-self.hidden // PANEL) * PANEL
        for p in self.pools:
            width = p.i_end - p.i_begin
            gate_up = 2 * width // PANEL * panel_bytes(self.method, self.group, self.hidden_padded)
            down = hp // PANEL * panel_bytes(self.down_method, self.down_group, width) if width else 0
            if (gate_up, down) != (p.gate_up_bytes, p.down_bytes):
                raise ValueError(
                    f"packed layout of {self.method.value}: the engine reports {p.gate_up_bytes} / "
                    f"{p.down_bytes} bytes of gate/up / down per expert, the layout gives {gate_up} / {down}"
                )


def decode_experts(
    layout: PackedLayout, gate_up: list[torch.Tensor], down: list[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed bytes of n experts, per pool (``gate_up[p] [n, gate_up_bytes]``, ``down[p] [n,
    down_bytes]``, uint8 on any device) -> ``w13 [n, 2I, H]`` (gate rows, then up rows) and
    ``w2 [n, H, I]`` in ``dtype`` on that device: the hot-expert kernels' layout."""
    H, I, b = layout.hidden, layout.intermediate, layout.gate_up_block
    hp = -(-H // PANEL) * PANEL
    gates, ups, downs = [], [], []
    for pool, gu, d in zip(layout.pools, gate_up, down, strict=True):
        width = pool.i_end - pool.i_begin
        if width == 0:
            continue
        n = gu.shape[0]
        w = decode_panels(layout.method, layout.group, gu, 2 * width // PANEL, layout.hidden_padded)
        w = w.reshape(n, width // b, 2, b, layout.hidden_padded)  # blocks of b gate rows, then b up rows
        gates.append(w[:, :, 0].reshape(n, width, -1))
        ups.append(w[:, :, 1].reshape(n, width, -1))
        downs.append(decode_panels(layout.down_method, layout.down_group, d, hp // PANEL, width))
    gate = torch.cat(gates, dim=1)[:, :I, :H]
    up = torch.cat(ups, dim=1)[:, :I, :H]
    w2 = torch.cat(downs, dim=2)[:, :H, :I]
    return torch.cat([gate, up], dim=1).to(dtype), w2.to(dtype)
