"""The routing split as one Triton kernel (CUDA); same semantics as `split_routing_torch`.

One program handles BLOCK_T tokens, all k selections of each: a cold selection is deferred when
fewer than ``max_deferred`` cold selections of the same token rank before it (lower weight, or equal
weight and an earlier slot). No host synchronization: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kt_sglang.kernels.split import RoutingSplit


@triton.jit
def _split_kernel(
    ids_ptr,
    weights_ptr,
    slot_of_ptr,
    hot_ptr,
    cold_ptr,
    deferred_ptr,
    num_tokens,
    num_experts,
    max_deferred,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # [BLOCK_T, 1]
    j = tl.arange(0, K_PAD)[None, :]  # [1, K_PAD]
    inside = (tok < num_tokens) & (j < K)
    ids = tl.load(ids_ptr + tok * K + j, mask=inside, other=-1).to(tl.int64)
    w = tl.load(weights_ptr + tok * K + j, mask=inside, other=0.0).to(tl.float32)
    valid = (ids >= 0) & (ids < num_experts)
    slot = tl.load(slot_of_ptr + ids, mask=valid, other=-1)
    hot = valid & (slot >= 0)
    cold = valid & (slot < 0)
    rank = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for i in tl.static_range(K):  # count the cold selections that rank before each one
        ids_i = tl.load(ids_ptr + tok * K + i, mask=tok < num_tokens, other=-1).to(tl.int64)
        w_i = tl.load(weights_ptr + tok * K + i, mask=tok < num_tokens, other=0.0).to(tl.float32)
        valid_i = (ids_i >= 0) & (ids_i < num_experts)
        slot_i = tl.load(slot_of_ptr + ids_i, mask=valid_i, other=0)
        cold_i = valid_i & (slot_i < 0)
        before = cold_i & ((w_i < w) | ((w_i == w) & (i < j)))
        rank += before.to(tl.int32)
    deferred = cold & (rank < max_deferred)
    none = tl.full([BLOCK_T, K_PAD], -1, tl.int64)
    tl.store(hot_ptr + tok * K + j, tl.where(hot, slot.to(tl.int64), none), mask=inside)
    tl.store(cold_ptr + tok * K + j, tl.where(cold & ~deferred, ids, none), mask=inside)
    tl.store(deferred_ptr + tok * K + j, tl.where(deferred, ids, none), mask=inside)


def split_routing_triton(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, gpu_slot_of: torch.Tensor, max_deferred: int
) -> RoutingSplit:
    """Same arguments and result as `split_routing_torch` (int64 outputs); tensors on one device."""
    T, k = topk_ids.shape
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    slot_of = gpu_slot_of.to(device=ids.device, dtype=torch.int64).contiguous()
    out = torch.empty((3, T, k), dtype=torch.int64, device=ids.device)
    if T and k:
        block_t = 16
        _split_kernel[(triton.cdiv(T, block_t),)](
            ids,
            weights,
            slot_of,
            out[0],
            out[1],
            out[2],
            T,
            slot_of.shape[0],
            max_deferred,
            K=k,
            K_PAD=triton.next_power_of_2(k),
            BLOCK_T=block_t,
        )
    return RoutingSplit(hot_ids=out[0], cold_ids=out[1], deferred_ids=out[2])
