"""GGUF block types as the engine's canonical matrices: one table, one transcoder per type.

Each GGUF type a MoE file stores its experts in maps onto the layout of an engine method
(``kt_sglang.engine.canonical``), with the values the file's own decoder (``gguf.quants``, llama.cpp's
numpy twin) gives:

- exactly, where the type is one: Q8_0, Q5_0, IQ4_NL -> AMXINT8 (int8 codes, fp16 scale per 32);
  Q4_0, Q4_1 -> AMXINT4 (nibbles, fp16 scale and min per 32); MXFP4 -> MXFP4; BF16 -> BF16;
- with the sub-block scale ``d * sc`` (and min ``dmin * m``) rounded once to fp16 (relative 2^-11),
  where a super-block scales 6-bit sub-block factors: Q4_K -> AMXINT4, IQ4_XS -> AMXINT8; F16/F32
  are rounded to bf16.

A type outside the table is refused by the format, naming the tensor and its type.

A transcoder takes one matrix's rows as the file stores them, ``uint8 [N, K / block * bytes]`` (K
contiguous, as llama.cpp writes ``ffn_*_exps`` tensors: ``ne0 = K``), and returns its canonical
tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kt_sglang.engine.canonical import CanonicalMatrix

Q = GGMLQuantizationType
# llama.cpp's non-linear 4-bit codebook (IQ4_NL, IQ4_XS)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
SUPER_BLOCK = 256  # the K-quants' and IQ4_XS's super-block


@dataclass(frozen=True)
class BlockType:
    """How one GGUF type becomes an engine method's canonical matrix."""

    method: str  # the engine method computing it (``--kt-method`` name)
    group: int  # that method's group size for it
    exact: bool  # the canonical values are the file's, bit for bit
    transcode: Callable[[np.ndarray, int], CanonicalMatrix]  # (rows [N, bytes], K) -> matrix


def _blocks(rows: np.ndarray, qtype: Q) -> np.ndarray:
    """``[N, K / block, bytes per block]``"""
    _, size = GGML_QUANT_SIZES[qtype]
    return rows.reshape(rows.shape[0], -1, size)


def _f16(b: np.ndarray) -> np.ndarray:
    """fp16 fields ``[..., 2]`` bytes -> float32 ``[...]``"""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """A block's ``[..., n]`` bytes -> ``[..., 2n]`` codes: low nibbles are elements 0..n-1, high
    nibbles n..2n-1 (the order of Q4_0, Q4_1, Q5_x, IQ4_NL, MXFP4 and an IQ4_XS sub-block)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _pack_nibbles(q: np.ndarray) -> torch.Tensor:
    """Codes ``[N, K]`` in 0..15 -> the canonical bytes ``[N, K / 2]``, low nibble at the even k."""
    q = q.reshape(q.shape[0], -1).astype(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)))


def _fp16(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x.reshape(x.shape[0], -1), dtype=np.float32)).half()


def _int8(codes: np.ndarray, scales: np.ndarray) -> CanonicalMatrix:
    weight = torch.from_numpy(np.ascontiguousarray(codes.reshape(codes.shape[0], -1), dtype=np.int8))
    return CanonicalMatrix(weight=weight, scales=_fp16(scales))


def _int4(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> CanonicalMatrix:
    return CanonicalMatrix(weight=_pack_nibbles(codes), scales=_fp16(scales), mins=_fp16(mins))


# ------------------------------------------------------------------------------------------------
# Blocks of 32 with one scale


def _q8_0(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.Q8_0)  # d fp16, qs int8[32]
    return _int8(b[..., 2:].view(np.int8), _f16(b[..., :2]))


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's 32-bit ``qh`` (bit j: the fifth bit of element j) -> ``[..., 32]`` values 0 or 16."""
    bits = np.ascontiguousarray(qh).view("<u4")[..., 0:1] >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _q5_0(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.Q5_0)  # d fp16, qh u32, qs[16]
    q = _split_nibbles(b[..., 6:]) | _q5_high_bits(b[..., 2:6])
    return _int8(q.astype(np.int16) - 16, _f16(b[..., :2]))


def _iq4_nl(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.IQ4_NL)  # d fp16, qs[16]
    return _int8(IQ4_VALUES[_split_nibbles(b[..., 2:])], _f16(b[..., :2]))


def _q4_0(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.Q4_0)  # d fp16, qs[16]; w = d * (q - 8)
    d = _f16(b[..., :2])
    return _int4(_split_nibbles(b[..., 2:]), d, -8 * d)


def _q4_1(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.Q4_1)  # d fp16, m fp16, qs[16]; w = d * q + m
    return _int4(_split_nibbles(b[..., 4:]), _f16(b[..., :2]), _f16(b[..., 2:4]))


def _mxfp4(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.MXFP4)  # e8m0 exponent, qs[16] (e2m1 codes)
    weight = _pack_nibbles(_split_nibbles(b[..., 1:]))
    scales = torch.from_numpy(np.ascontiguousarray(b[..., 0])).view(torch.float8_e8m0fnu)
    return CanonicalMatrix(weight=weight, scales=scales)


# ------------------------------------------------------------------------------------------------
# Super-blocks of 256: 8 sub-blocks of 32 with 6-bit factors of the super-block's fp16 scale(s)


def _q4_k_factors(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's (and Q5_K's) 12 bytes -> the 8 sub-blocks' 6-bit scale and min factors."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, m


def _q4_k(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.Q4_K)  # d, dmin fp16, scales[12], qs[128]; w = d * sc * q - dmin * m
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, m = _q4_k_factors(b[..., 4:16])
    # qs: 4 chunks of 32 bytes, chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high
    qs = b[..., 16:].reshape(*b.shape[:2], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    codes = (qs & 0x0F).reshape(*b.shape[:2], SUPER_BLOCK)
    return _int4(codes, d * sc, -(dmin * m))


def _iq4_xs(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.IQ4_XS)  # d fp16, scales_h u16, scales_l[4], qs[128]; w = d * (ls - 32) * kv
    d = _f16(b[..., 0:2])[..., None]
    high = np.ascontiguousarray(b[..., 2:4]).view("<u2")[..., 0:1] >> (2 * np.arange(8, dtype=np.uint16))
    low = b[..., 4:8, None] >> np.array([0, 4], np.uint8)
    ls = (low.reshape(*b.shape[:2], 8) & 0x0F) | ((high & 3).astype(np.uint8) << 4)
    codes = _split_nibbles(b[..., 8:].reshape(*b.shape[:2], 8, 16))
    return _int8(IQ4_VALUES[codes], d * (ls.astype(np.float32) - 32))


# ------------------------------------------------------------------------------------------------
# Floats


def _floats(dtype: np.dtype) -> Callable[[np.ndarray, int], CanonicalMatrix]:
    def transcode(rows: np.ndarray, K: int) -> CanonicalMatrix:
        if dtype == "bf16":
            w = torch.from_numpy(np.ascontiguousarray(rows).view(np.int16)).view(torch.bfloat16)
        else:
            w = torch.from_numpy(np.ascontiguousarray(rows).view(dtype)).to(torch.bfloat16)
        return CanonicalMatrix(weight=w.reshape(rows.shape[0], K).contiguous())

    return transcode


BLOCK_TYPES: dict[Q, BlockType] = {
    Q.Q8_0: BlockType("AMXINT8", 32, True, _q8_0),
    Q.Q5_0: BlockType("AMXINT8", 32, True, _q5_0),
    Q.IQ4_NL: BlockType("AMXINT8", 32, True, _iq4_nl),
    Q.IQ4_XS: BlockType("AMXINT8", 32, False, _iq4_xs),
    Q.Q4_0: BlockType("AMXINT4", 32, True, _q4_0),
    Q.Q4_1: BlockType("AMXINT4", 32, True, _q4_1),
    Q.Q4_K: BlockType("AMXINT4", 32, False, _q4_k),
    Q.MXFP4: BlockType("MXFP4", 32, True, _mxfp4),
    Q.BF16: BlockType("BF16", 64, True, _floats("bf16")),
    Q.F16: BlockType("BF16", 64, False, _floats(np.dtype(np.float16))),
    Q.F32: BlockType("BF16", 64, False, _floats(np.dtype(np.float32))),
}


def block_type(qtype: Q) -> BlockType | None:
    return BLOCK_TYPES.get(qtype)
