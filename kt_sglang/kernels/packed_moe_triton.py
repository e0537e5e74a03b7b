"""Streamed experts' MoE computed straight from the engine's packed layout (CUDA), dequantizing in the
kernel; same result as `hot_moe_torch` on the weights `decode_experts` gives.

The GPU prefill (kt_sglang/layer/prefill.py) copies a layer's experts to the GPU as the engine packs
them (kt_sglang/kernels/packed.py, native/include/kt/quant_types.h): per pool, ``gate_up [S, bytes]``
and ``down [S, bytes]``. These kernels read those bytes where they lie: each program loads the
16-channel panels of its output channels one K-block at a time, turns the codes and the group's scale
block into weights in registers, and multiplies; no bf16 copy of the experts is made. The selections
are grouped by expert as for the hot experts (`align_by_slot`), then per pool

1. gate/up: ``inter[row, pool channels] = silu(x Wg^T) * (x Wu^T)`` in ``dtype`` (fp32 accumulation);
2. down: ``partial[row] (+)= w[row] * inter[row, pool channels] Wd_pool^T`` in fp32 (the pools' slices
   of the intermediate dimension add up);

and the k partial rows of each token are summed. The weights are decoded to fp32 exactly as
`decode_experts` does (same operations, same order) and rounded to ``dtype`` before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kt_sglang.engine.methods import METHODS, Method
from kt_sglang.kernels.hot_moe_triton import align_by_slot, block_rows, dot
from kt_sglang.kernels.packed import PANEL, PackedLayout, group_bytes, panel_bytes

# The methods these kernels decode, and the decoder each uses (`_dequant`'s KIND). A layer whose
# gate/up or down method is missing here is decoded by torch (`decode_experts`) and computed by
# `hot_moe`: `covers` says which path a layout takes.
_BF16, _INT8, _INT4, _FP8, _RAWINT4, _GPTQ, _MXFP4, _NVFP4 = range(8)
KERNEL_METHODS: dict[Method, int] = {
    Method.BF16: _BF16,
    Method.AMXINT8: _INT8,
    Method.AMXINT4: _INT4,
    Method.FP8: _FP8,
    Method.FP8_PERCHANNEL: _FP8,
    Method.RAWINT4: _RAWINT4,
    Method.GPTQ_INT4: _GPTQ,
    Method.MXFP4: _MXFP4,
    Method.NVFP4: _NVFP4,
}

BLOCK_N = 64  # output channels per program
MAX_BLOCK_K = 64  # K-values per step: a group of 128 is two steps (bounds the decoded tile's registers)


def covers(layout: PackedLayout) -> bool:
    """Whether these kernels compute a layer of this layout (else: `decode_experts` + `hot_moe`)."""
    return layout.method in KERNEL_METHODS and layout.down_method in KERNEL_METHODS


@triton.jit
def _bf16_bits(u16):
    """bf16 bit patterns (uint16) -> float32, exactly."""
    return (u16.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(v):
    """float8 e4m3fn codes (int32 0..255) -> float32, exactly (NaN codes are refused when packing)."""
    e = (v >> 3) & 15
    m = v & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormals: m * 2^-9
    return tl.where((v & 128) != 0, -mag, mag)


@triton.jit
def _e2m1(q):
    """float4 e2m1 codes (int32 0..15) -> float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    e = (q >> 1) & 3
    m = (q & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((q & 8) != 0, -mag, mag)


@triton.jit
def _scale(ptr, offset, dtype: tl.constexpr):
    return tl.load((ptr + offset).to(tl.pointer_type(dtype))).to(tl.float32)


@triton.jit
def _dequant(group_ptr, kk, c, mask, KIND: tl.constexpr, GROUP: tl.constexpr, WEIGHT_BYTES: tl.constexpr):
    """Weights ``W[channel c, K-value kk]`` of one packed group, float32 ``[K, N]``.

    ``group_ptr [1, N]``: the group's first byte in each column's panel; ``kk [K, 1]``: K-values within
    the group; ``c [1, N]``: channels within the panel; ``mask``: which weights to load (others: code 0).
    The byte orders are those of quant_types.h; the scales follow the group's weights."""
    scales = group_ptr + WEIGHT_BYTES
    if KIND == 0:  # BF16: row kk // 2 holds 16 channels x 2 K-values
        u16 = tl.load(
            (group_ptr + (kk // 2) * 64 + c * 4 + (kk % 2) * 2).to(tl.pointer_type(tl.uint16)),
            mask=mask,
            other=0,
        )
        w = _bf16_bits(u16)
    elif KIND == 3:  # FP8: BF16's order at a byte a weight, two rows' 8-byte pieces interleaved (fp8.h)
        r = kk // 2
        b = 2 * c + kk % 2
        v = tl.load(group_ptr + (r // 2) * 64 + (b // 8) * 16 + (r % 2) * 8 + b % 8, mask=mask, other=0)
        w = _scale(scales, c * 4, tl.float32) * _e4m3(v.to(tl.int32))
    elif KIND == 1:  # INT8: row kk // 4 holds 16 channels x 4 K-values, + 128
        v = tl.load(group_ptr + (kk // 4) * 64 + c * 4 + kk % 4, mask=mask, other=128).to(tl.int32)
        w = _scale(scales, c * 2, tl.float16) * (v - 128).to(tl.float32)
    else:  # 4-bit: int8-row r's nibbles: low ones in byte row r, high ones in byte row r - GROUP / 8
        r = kk // 4
        byte = tl.load(group_ptr + (r % (GROUP // 8)) * 64 + c * 4 + kk % 4, mask=mask, other=0).to(tl.int32)
        q = (byte >> ((r // (GROUP // 8)) * 4)) & 15
        if KIND == 2:  # AMXINT4: scale * q + min
            w = _scale(scales, c * 2, tl.float16) * q.to(tl.float32) + _scale(scales, 32 + c * 2, tl.float16)
        elif KIND == 4:  # RAWINT4: bf16 scale * (q - 8)
            s = _bf16_bits(tl.load((scales + c * 2).to(tl.pointer_type(tl.uint16))))
            w = s * (q - 8).to(tl.float32)
        elif KIND == 5:  # GPTQ_INT4: scale * (q + (-zero))
            w = _scale(scales, c * 2, tl.float16) * (
                q.to(tl.float32) + _scale(scales, 32 + c * 2, tl.float16)
            )
        elif KIND == 6:  # MXFP4: 2^(e8m0 - 127) * e2m1
            e = tl.load(scales + c).to(tl.int32)
            power = tl.where(e == 0, 5.877471754111438e-39, (e << 23).to(tl.float32, bitcast=True))
            w = power * _e2m1(q)
        else:  # NVFP4: e4m3 scale * the matrix's fp32 global * e2m1
            s = _e4m3(tl.load(scales + c).to(tl.int32)) * _scale(scales, 16, tl.float32)
            w = s * _e2m1(q)
    return w


@triton.jit
def _packed_gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [S, expert_bytes] uint8: this pool's packed gate/up
    inter_ptr,  # [T*k, I]
    rows_ptr,
    block_slot_ptr,
    num_rows,
    top_k,
    H,
    I,
    i_begin,  # the pool's first intermediate channel
    channels,  # the pool's channels below I
    expert_bytes,
    panel_bytes,  # a panel's bytes (all of K)
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_BYTES: tl.constexpr,
    WEIGHT_BYTES: tl.constexpr,
    GATE_UP_BLOCK: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot, rows, row_ok = block_rows(rows_ptr, block_slot_ptr, num_rows, BLOCK_M)
    if slot < 0:
        return
    token = tl.where(row_ok, rows // top_k, 0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # the pool's channels
    j_ok = j < channels
    j = tl.where(j_ok, j, 0)  # columns past the pool's channels read channel 0 (not stored)
    # Blocks of GATE_UP_BLOCK gate rows, then as many up rows: channel j's row in panel order.
    gate_row = (j // GATE_UP_BLOCK) * 2 * GATE_UP_BLOCK + j % GATE_UP_BLOCK
    up_row = gate_row + GATE_UP_BLOCK
    expert = w_ptr + slot * expert_bytes
    gate_col = (expert + (gate_row // 16) * panel_bytes)[None, :]
    up_col = (expert + (up_row // 16) * panel_bytes)[None, :]
    c = (j % 16)[None, :]  # the same channel within both panels (GATE_UP_BLOCK is a multiple of 16)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dot_t = inter_ptr.dtype.element_ty
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < H
        a = tl.load(x_ptr + token[:, None] * H + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        group = (k0 // GROUP) * GROUP_BYTES
        in_group = (k0 % GROUP + tl.arange(0, BLOCK_K))[:, None]
        mask = k_ok[:, None] & j_ok[None, :]
        wg = _dequant(gate_col + group, in_group, c, mask, KIND, GROUP, WEIGHT_BYTES)
        wu = _dequant(up_col + group, in_group, c, mask, KIND, GROUP, WEIGHT_BYTES)
        a = a.to(dot_t)
        gate += dot(a, wg.to(dot_t), FP32_DOT)
        up += dot(a, wu.to(dot_t), FP32_DOT)
    h = gate * tl.sigmoid(gate) * up
    tl.store(
        inter_ptr + rows[:, None] * I + (i_begin + j)[None, :],  # j_ok masks the columns set to 0
        h.to(dot_t),
        mask=row_ok[:, None] & j_ok[None, :],
    )


@triton.jit
def _packed_down_kernel(
    inter_ptr,  # [T*k, I]
    w_ptr,  # [S, expert_bytes] uint8: this pool's packed down projection
    weights_ptr,  # [T*k] router weights, fp32
    out_ptr,  # [T*k, H] fp32
    rows_ptr,
    block_slot_ptr,
    num_rows,
    H,
    I,
    i_begin,
    channels,  # the pool's intermediate channels below I: its K
    expert_bytes,
    panel_bytes,  # a panel's bytes (all of the pool's K)
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_BYTES: tl.constexpr,
    WEIGHT_BYTES: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # add to what an earlier pool wrote
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot, rows, row_ok = block_rows(rows_ptr, block_slot_ptr, num_rows, BLOCK_M)
    if slot < 0:
        return
    safe_rows = tl.where(row_ok, rows, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    n = tl.where(n_ok, n, 0)  # columns past H read channel 0 (not stored)
    col = (w_ptr + slot * expert_bytes + (n // 16) * panel_bytes)[None, :]
    c = (n % 16)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dot_t = inter_ptr.dtype.element_ty
    for k0 in range(0, channels, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < channels
        a = tl.load(
            inter_ptr + safe_rows[:, None] * I + (i_begin + kk)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        in_group = (k0 % GROUP + tl.arange(0, BLOCK_K))[:, None]
        w = _dequant(
            col + (k0 // GROUP) * GROUP_BYTES,
            in_group,
            c,
            k_ok[:, None] & n_ok[None, :],
            KIND,
            GROUP,
            WEIGHT_BYTES,
        )
        acc += dot(a, w.to(dot_t), FP32_DOT)
    route = tl.load(weights_ptr + safe_rows, mask=row_ok, other=0.0)
    acc = acc * route[:, None]
    out = out_ptr + rows[:, None] * H + (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0)
    tl.store(out, acc, mask=mask)


def _method_args(method: Method, group: int) -> dict:
    return {
        "KIND": KERNEL_METHODS[method],
        "GROUP": group,
        "GROUP_BYTES": group_bytes(method, group),
        "WEIGHT_BYTES": PANEL * group * METHODS[method].weight_bits // 8,
    }


def _check_bytes(
    name: str, tensors: list[torch.Tensor], sizes: list[int], S: int, device: torch.device
) -> None:
    if len(tensors) != len(sizes):
        raise ValueError(f"{name}: {len(tensors)} tensors for a layout of {len(sizes)} pools")
    for p, (t, size) in enumerate(zip(tensors, sizes, strict=True)):
        if t.dtype != torch.uint8 or tuple(t.shape) != (S, size) or not t.is_contiguous():
            raise ValueError(
                f"{name}[{p}]: {t.dtype} {tuple(t.shape)}, expected contiguous uint8 [{S}, {size}] "
                "(the pool's packed bytes per expert)"
            )
        if t.device != device:
            raise ValueError(f"{name}[{p}] is on {t.device}, the hidden states on {device}")


def packed_moe_triton(
    hidden: torch.Tensor,
    layout: PackedLayout,
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block_m: int | None = None,
) -> torch.Tensor:
    """The MoE of S packed experts: ``hot_moe_torch(hidden, *decode_experts(layout, gate_up, down,
    dtype), slot_ids, weights)`` without decoding them to memory.

    Parameters
    ----------
    hidden : ``[T, H]`` (H = ``layout.hidden``)
    layout : the packed layout (`covers` it)
    gate_up, down : per pool of the layout, uint8 ``[S, pool.gate_up_bytes]`` / ``[S, pool.down_bytes]``
        contiguous, on the device of ``hidden``: expert ``s``'s packed bytes in row ``s``
    slot_ids : ``[T, k]``, the row of each selection's expert, -1: no expert
    weights : ``[T, k]`` router weights
    dtype : what the GEMMs read (bf16, fp16 or fp32; fp32 accumulation)
    block_m : selections per program (16 or more, a power of two); None: 64 where the experts have
        that many selections on average, else 16

    Returns
    -------
    fp32 ``[T, H]``
    """
    if not covers(layout):
        raise ValueError(
            f"no packed kernels for {layout.method.value} / {layout.down_method.value}: "
            "decode with decode_experts and compute with hot_moe"
        )
    T, H = hidden.shape
    if H != layout.hidden:
        raise ValueError(f"hidden {tuple(hidden.shape)}: the layout's hidden size is {layout.hidden}")
    if slot_ids.shape != weights.shape or slot_ids.dim() != 2 or slot_ids.shape[0] != T:
        raise ValueError(
            f"slot_ids {tuple(slot_ids.shape)} / weights {tuple(weights.shape)}: expected [{T}, k]"
        )
    S = gate_up[0].shape[0] if gate_up else 0
    _check_bytes("gate_up", gate_up, [p.gate_up_bytes for p in layout.pools], S, hidden.device)
    _check_bytes("down", down, [p.down_bytes for p in layout.pools], S, hidden.device)
    k, I = slot_ids.shape[1], layout.intermediate
    partial = torch.zeros((T * k, H), dtype=torch.float32, device=hidden.device)
    if T == 0 or k == 0 or S == 0:
        return partial.view(T, k, H).sum(1)
    if block_m is None:
        block_m = 64 if T * k >= 64 * S else 16
    blocks = align_by_slot(slot_ids, S, block_m)
    num_blocks = blocks.block_slot.shape[0]
    inter = torch.empty((T * k, I), dtype=dtype, device=hidden.device)
    x = hidden.contiguous()
    route = weights.reshape(-1).float().contiguous()
    fp32 = dtype == torch.float32
    gate_up_args = _method_args(layout.method, layout.group)
    down_args = _method_args(layout.down_method, layout.down_group)
    written = False
    for pool, gu, d in zip(layout.pools, gate_up, down, strict=True):
        channels = min(pool.i_end, I) - pool.i_begin  # padding channels past I are left out
        if channels <= 0:
            continue
        common = {"FP32_DOT": fp32, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N}
        _packed_gate_up_kernel[(num_blocks, triton.cdiv(channels, BLOCK_N))](
            x, gu, inter, blocks.rows, blocks.block_slot, T * k, k, H, I, pool.i_begin, channels,
            pool.gate_up_bytes, panel_bytes(layout.method, layout.group, layout.hidden_padded),
            GATE_UP_BLOCK=layout.gate_up_block, BLOCK_K=min(layout.group, MAX_BLOCK_K),
            **gate_up_args, **common,
        )  # fmt: skip
        width = pool.i_end - pool.i_begin
        _packed_down_kernel[(num_blocks, triton.cdiv(H, BLOCK_N))](
            inter, d, route, partial, blocks.rows, blocks.block_slot, T * k, H, I, pool.i_begin, channels,
            pool.down_bytes, panel_bytes(layout.down_method, layout.down_group, width),
            ACCUMULATE=written, BLOCK_K=min(layout.down_group, MAX_BLOCK_K), **down_args, **common,
        )  # fmt: skip
        written = True
    return partial.view(T, k, H).sum(1)
