"""The hot experts' MoE as Triton grouped GEMMs (CUDA); same semantics as `hot_moe_torch`.

The selections ``(token, j)`` with a GPU slot are grouped by slot into blocks of BLOCK_M rows
(`align_by_slot`: one program, no host synchronization, so a CUDA graph can capture it; the grid
is sized for the worst case and blocks without work return at once). Then

1. gate/up: ``inter[row] = silu(x Wg_s^T) * (x Wu_s^T)`` in the weights' dtype (fp32 accumulation);
2. down: ``partial[row] = w[row] * inter[row] W2_s^T`` in fp32;

and the k partial rows of each token are summed. Rows of selections with slot -1 stay zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows (selections) per block: tl.dot's minimum, and decode batches are small


@dataclass
class SlotBlocks:
    """Selection rows grouped by GPU slot, padded to BLOCK_M per slot."""

    rows: torch.Tensor  # [capacity] flat selection index t*k + j, or num_rows (padding)
    block_slot: torch.Tensor  # [capacity // BLOCK_M] slot of each block, -1 for unused blocks


def align_by_slot_torch(slot_ids: torch.Tensor, num_slots: int, block_m: int = BLOCK_M) -> SlotBlocks:
    """Groups the flat selections of ``slot_ids [T, k]`` (-1 = not hot) by slot, in torch ops
    (about twenty launches: for batches above `ALIGN_KERNEL_MAX_ROWS` selections, where they cost
    less than one program walking every selection)."""
    flat = slot_ids.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    key = torch.where(flat >= 0, flat, num_slots)  # not-hot rows sort last, into a dummy slot
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device).scatter_add_(
        0, key, torch.ones_like(key)
    )
    padded = (counts[:num_slots] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    start_in_sorted = torch.cumsum(counts, 0) - counts  # where each slot's rows begin in `order`
    rank = torch.arange(n, device=device) - start_in_sorted[sorted_key]
    dest = (padded_end - padded)[sorted_key.clamp_max(num_slots - 1)] + rank
    capacity = _capacity(n, num_slots, block_m)
    rows = torch.full((capacity + 1,), n, dtype=torch.int64, device=device)
    hot = sorted_key < num_slots
    rows.scatter_(0, torch.where(hot, dest, capacity), order)  # not-hot rows land in the spare cell
    block_start = torch.arange(0, capacity, block_m, device=device)
    block_slot = torch.searchsorted(padded_end, block_start, right=True)
    block_slot = torch.where(block_slot < num_slots, block_slot, -1)
    return SlotBlocks(rows=rows[:capacity], block_slot=block_slot)


def _capacity(n: int, num_slots: int, block_m: int) -> int:
    """Rows of the worst case: every slot's last block part padding."""
    return (n + num_slots * (block_m - 1) + block_m - 1) // block_m * block_m


@triton.jit
def _align_kernel(
    slot_ids_ptr,  # [n] slot of each selection, -1 = not hot
    rows_ptr,  # [capacity] out
    block_slot_ptr,  # [capacity // BLOCK_M] out
    n,
    num_slots,
    capacity,
    BLOCK_M: tl.constexpr,
    S_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program: count each slot's selections, lay the slots out in blocks of BLOCK_M rows, then
    place each selection at its slot's next row (in selection order, as a stable sort would)."""
    s = tl.arange(0, S_PAD)
    counts = tl.zeros([S_PAD], dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        slot = tl.load(slot_ids_ptr + i, mask=i < n, other=-1).to(tl.int32)
        counts += tl.sum((slot[:, None] == s[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    for r0 in range(0, capacity, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(rows_ptr + r, tl.zeros([CHUNK], dtype=tl.int64) + n, mask=r < capacity)
        first = r * BLOCK_M  # block r's first row; a slot owns it if the slot's blocks end after it
        owner = tl.sum((end[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_slot_ptr + r, tl.where(owner < num_slots, owner, -1), mask=first < capacity)
    tl.debug_barrier()  # the padding above is written before any selection's row below
    next_row = end - padded
    for c0 in range(0, n, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        slot = tl.load(slot_ids_ptr + i, mask=i < n, other=-1).to(tl.int32)
        match = (slot[:, None] == s[None, :]).to(tl.int32)
        earlier = tl.cumsum(match, axis=0) - match  # same-slot selections before it in this chunk
        dest = tl.sum(match * (earlier + next_row[None, :]), axis=1)
        tl.store(rows_ptr + dest, i.to(tl.int64), mask=(i < n) & (slot >= 0))
        next_row += tl.sum(match, axis=0)


ALIGN_KERNEL_MAX_ROWS = 4096  # selections (T * k) up to which one program aligns them


def align_by_slot(slot_ids: torch.Tensor, num_slots: int, block_m: int = BLOCK_M) -> SlotBlocks:
    """Groups the flat selections of ``slot_ids [T, k]`` (-1 = not hot) by slot: `rows` lists each
    slot's selections (flat index t*k + j, in order) padded to a multiple of ``block_m`` with
    ``T * k``, and `block_slot` names each block's slot (-1: unused). One kernel launch for decode
    batches, no host synchronization either way (CUDA-graph capturable)."""
    n = slot_ids.numel()
    if n > ALIGN_KERNEL_MAX_ROWS or num_slots == 0:
        return align_by_slot_torch(slot_ids, num_slots, block_m)
    flat = slot_ids.reshape(-1).contiguous()
    capacity = _capacity(n, num_slots, block_m)
    rows = torch.empty(capacity, dtype=torch.int64, device=flat.device)
    block_slot = torch.empty(capacity // block_m, dtype=torch.int64, device=flat.device)
    s_pad = triton.next_power_of_2(num_slots + 1)
    _align_kernel[(1,)](
        flat, rows, block_slot, n, num_slots, capacity,
        BLOCK_M=block_m, S_PAD=s_pad, CHUNK=max(16, min(128, 8192 // s_pad)),
    )  # fmt: skip
    return SlotBlocks(rows=rows, block_slot=block_slot)


@triton.jit
def block_rows(rows_ptr, block_slot_ptr, num_rows, BLOCK_M: tl.constexpr):
    """This program's slot (-1: no work) and its BLOCK_M selection rows, with which are real."""
    block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return slot, rows, rows < num_rows


@triton.jit
def dot(a, b, FP32_DOT: tl.constexpr):
    """``a @ b`` with fp32 accumulation; fp32 inputs at full precision (not TF32)."""
    if FP32_DOT:  # fp32 inputs: full precision, not TF32
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [S, 2I, H]
    inter_ptr,  # [T*k, I]
    rows_ptr,
    block_slot_ptr,
    num_rows,
    top_k,
    H,
    I,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot, rows, row_ok = block_rows(rows_ptr, block_slot_ptr, num_rows, BLOCK_M)
    if slot < 0:
        return
    token = tl.where(row_ok, rows // top_k, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w13_ptr + slot * 2 * I * H
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < H
        a = tl.load(x_ptr + token[:, None] * H + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_base + n[None, :] * H + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(
            w_base + (I + n[None, :]) * H + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
        )
        a = a.to(wg.dtype)
        gate += dot(a, wg, FP32_DOT)
        up += dot(a, wu, FP32_DOT)
    h = gate * tl.sigmoid(gate) * up
    tl.store(
        inter_ptr + rows[:, None] * I + n[None, :],
        h.to(inter_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _down_kernel(
    inter_ptr,  # [T*k, I]
    w2_ptr,  # [S, H, I]
    weights_ptr,  # [T*k] router weights
    out_ptr,  # [T*k, H] fp32
    rows_ptr,
    block_slot_ptr,
    num_rows,
    H,
    I,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w2_ptr + slot * H * I
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < I
        a = tl.load(
            inter_ptr + safe_rows[:, None] * I + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(w_base + n[None, :] * I + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += dot(a, w, FP32_DOT)
    route = tl.load(weights_ptr + safe_rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * H + n[None, :], acc * route[:, None], mask=row_ok[:, None] & n_ok[None, :]
    )


def hot_moe_triton(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Same arguments and result as `hot_moe_torch`: fp32 ``[T, H]``; bf16, fp16 or fp32 weights."""
    T, H = hidden.shape
    k = slot_ids.shape[1]
    S, I = w2.shape[0], w2.shape[2]
    if tuple(w13.shape) != (S, 2 * I, H) or tuple(w2.shape) != (S, H, I):
        raise ValueError(
            f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}: expected [S, 2I, {H}] / [S, {H}, I]"
        )
    partial = torch.zeros((T * k, H), dtype=torch.float32, device=hidden.device)
    if T == 0 or k == 0 or S == 0:
        return partial.view(T, k, H).sum(1)
    blocks = align_by_slot(slot_ids, S)
    inter = torch.empty((T * k, I), dtype=w13.dtype, device=hidden.device)
    x, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    route = weights.reshape(-1).float().contiguous()
    fp32 = w13.dtype == torch.float32
    num_blocks = blocks.block_slot.shape[0]
    block_n, block_k = 64, 64 if not fp32 else 32
    _gate_up_kernel[(num_blocks, triton.cdiv(I, block_n))](
        x, w13, inter, blocks.rows, blocks.block_slot, T * k, k, H, I,
        FP32_DOT=fp32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    _down_kernel[(num_blocks, triton.cdiv(H, block_n))](
        inter, w2, route, partial, blocks.rows, blocks.block_slot, T * k, H, I,
        FP32_DOT=fp32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return partial.view(T, k, H).sum(1)
