"""GGUF files for the tests, written with the ``gguf`` package (llama.cpp's own Python side) the way
llama.cpp names a MoE model's tensors; values as llama.cpp's numpy decoders give them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from kt_sglang.weights.gguf_blocks import random_rows


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``w [..., K]`` (K a multiple of 256) as Q4_K rows ``uint8 [..., K / 256 * 144]``: per sub-block
    of 32 a scale and a min over its range, both 6-bit factors of the super-block's fp16 ``d`` and
    ``dmin`` (llama.cpp's layout; the gguf package only decodes this type)."""
    *lead, K = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0)
    scale, mins = (x.max(-1) - low) / 15, -low
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.clip(np.rint(scale / d.astype(np.float32)), 0, 63)).astype(np.uint8)
        m = np.nan_to_num(np.clip(np.rint(mins / dmin.astype(np.float32)), 0, 63)).astype(np.uint8)
        step = (d.astype(np.float32) * sc)[..., None]
        q = np.nan_to_num(np.clip(np.rint((x + (dmin.astype(np.float32) * m)[..., None]) / step), 0, 15))
    q = q.astype(np.uint8)
    packed = np.empty((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], axis=-1)
    return blocks.reshape(*lead, -1)


# The types the gguf package decodes but has no quantizer for (besides Q4_K, quantize_q4_k's).
DECODE_ONLY = (Q.IQ4_NL, Q.IQ4_XS, Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q2_K)


def gguf_rows(qtype: Q, w: np.ndarray, seed: int = 0) -> np.ndarray:
    """``w [..., N, K]`` float32 as the GGUF type's rows ``uint8 [..., N, bytes]``: quantized where the
    gguf package (or ``quantize_q4_k``) has a quantizer, else random codes under scales of w's
    magnitude (``random_rows``: the types llama.cpp's Python side only decodes)."""
    if qtype in (Q.F16, Q.F32):
        return w.astype(np.float16 if qtype == Q.F16 else np.float32).view(np.uint8)
    if qtype == Q.Q4_K:
        return quantize_q4_k(w)
    if qtype in DECODE_ONLY:
        return random_rows(qtype, w.shape, float(np.abs(w).mean()), seed)
    return gguf.quants.quantize(w, qtype).view(np.uint8)


def llama_cpp_values(qtype: Q, rows: np.ndarray) -> np.ndarray:
    """The float32 values llama.cpp's decoder gives the rows."""
    if qtype in (Q.F16, Q.F32):
        return rows.view(np.float16 if qtype == Q.F16 else np.float32).astype(np.float32)
    return gguf.quants.dequantize(rows, qtype)


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, tuple[np.ndarray, Q]],
    metadata: dict[str, int | list[int]],
    split_max_tensors: int = 0,
) -> None:
    """``tensors``: name -> (rows as ``gguf_rows`` gives them, type); ``metadata``: ``{arch}.{key}``."""
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    for key, value in metadata.items():  # an int, or a list of one per layer
        (writer.add_array if isinstance(value, list) else writer.add_uint32)(f"{arch}.{key}", value)
    for name, (rows, qtype) in tensors.items():
        if qtype in (Q.F16, Q.F32):
            writer.add_tensor(name, rows.view(np.float16 if qtype == Q.F16 else np.float32))
        else:
            writer.add_tensor(name, rows, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_from_checkpoint(model_dir: Path, out: Path, qtype: Q) -> dict[int, dict[str, np.ndarray]]:
    """The routed experts of a Hugging Face MoE checkpoint as a GGUF file of ``qtype`` (Qwen3-MoE's
    names and metadata); returns each layer's values as llama.cpp decodes them."""
    from kt_sglang.weights.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model_dir)
    spec = ckpt.spec
    tensors, values = {}, {}
    for layer in spec.moe_layers:
        weights = ckpt.layer_experts(layer)
        values[layer] = {}
        for proj, w in zip(("gate", "up", "down"), weights, strict=True):
            rows = gguf_rows(qtype, w.float().numpy())
            tensors[f"blk.{layer}.ffn_{proj}_exps.weight"] = (rows, qtype)
            values[layer][proj] = llama_cpp_values(qtype, rows)
    meta = {
        "block_count": spec.num_layers,
        "expert_count": spec.num_experts,
        "expert_used_count": spec.top_k,
        "embedding_length": spec.hidden_size,
        "expert_feed_forward_length": spec.intermediate_size,
    }
    write_gguf(out, "qwen3moe", tensors, meta)
    return values
