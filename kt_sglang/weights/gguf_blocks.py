"""GGUF block types as the engine's canonical matrices: one table, one transcoder per type.

Each GGUF type a MoE file stores its experts in maps onto the layout of an engine method
(``kt_sglang.engine.canonical``), with the values the file's own decoder (``gguf.quants``, llama.cpp's
numpy twin) gives:

- exactly, where the type is one: Q8_0, Q5_0, IQ4_NL -> AMXINT8 (int8 codes, fp16 scale per 32);
  Q4_0, Q4_1 -> AMXINT4 (nibbles, fp16 scale and min per 32); MXFP4 -> MXFP4; BF16 -> BF16;
- with the sub-block scale ``d * sc`` (and min ``dmin * m``) rounded once to fp16 (relative 2^-11),
  where a super-block scales 6-bit sub-block factors: Q4_K -> AMXINT4 (groups of 32), Q2_K and Q3_K
  -> AMXINT4 (16), Q6_K -> AMXINT8 (16), IQ4_XS -> AMXINT8 (32); F16/F32 are rounded to bf16;
- requantized by the engine's INT8 quantizer from the file's values, where no layout holds 5-bit
  codes with a min: Q5_1, Q5_K -> AMXINT8 (32; relative error about a quarter of the type's own).

A type outside the table is refused by the format, naming the tensor and its type.

A transcoder takes one matrix's rows as the file stores them, ``uint8 [N, K / block * bytes]`` (K
contiguous, as llama.cpp writes ``ffn_*_exps`` tensors: ``ne0 = K``), and returns its canonical
tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kt_sglang.engine.canonical import CanonicalMatrix, quantize

Q = GGMLQuantizationType
# llama.cpp's non-linear 4-bit codebook (IQ4_NL, IQ4_XS)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
SUPER_BLOCK = 256  # the K-quants' and IQ4_XS's super-block


@dataclass(frozen=True)
class BlockType:
    """How one GGUF type becomes an engine method's canonical matrix."""

    method: str  # the engine method computing it (``--kt-method`` name)
    group: int  # that method's group size for it
    # the largest |canonical value - the file's value| over the largest |file's value|: 0 where the
    # values are the file's; a scale rounded to fp16 once, 2^-10 at most
    error: float
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


def _shifted_pairs(qs: np.ndarray, halves: int) -> np.ndarray:
    """2-bit fields of Q2_K's and Q3_K's ``qs`` (``halves`` runs of 32 bytes): element
    ``128 h + 32 j + l`` is bits ``2j..2j+1`` of byte ``32 h + l``."""
    q = qs.reshape(*qs.shape[:-1], halves, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    return (q & 3).reshape(*qs.shape[:-1], halves * 128)


def _q6_k(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.Q6_K)  # ql[128], qh[64], scales int8[16], d fp16; w = d * sc * (q - 32)
    ql = b[..., 0:128].reshape(*b.shape[:2], 2, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # per half of 128: 64 low nibbles, then 64 high
    high = _shifted_pairs(b[..., 128:192], 2).reshape(*b.shape[:2], 2, 128)
    q = (low | (high << 4)).astype(np.int16) - 32
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    return _int8(q, _f16(b[..., 208:210])[..., None] * sc)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> its 16 sub-blocks' 6-bit factors minus 32: low nibbles of bytes 0..7 for
    sub-blocks 0..7, their high nibbles for 8..15; the two high bits from bytes 8..11."""
    i = np.arange(16)
    low = (s[..., i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 0x0F
    high = (s[..., 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    return (low | (high << 4)).astype(np.float32) - 32


def _q3_k(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.Q3_K)  # hmask[32], qs[64], scales[12], d fp16; w = d * sc * (q - 4 * !hbit)
    low = _shifted_pairs(b[..., 32:96], 2)
    hbit = (b[..., 0:32].reshape(*b.shape[:2], 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    codes = low + 4 * hbit.reshape(*b.shape[:2], 256)  # 0..7, standing for code - 4
    scale = _f16(b[..., 108:110])[..., None] * _q3_k_scales(b[..., 96:108])
    return _int4(codes, scale, -4 * scale)


def _q2_k(rows: np.ndarray, K: int) -> CanonicalMatrix:
    b = _blocks(rows, Q.Q2_K)  # scales[16] (sc | m << 4), qs[64], d, dmin fp16; w = d * sc * q - dmin * m
    d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    scales = b[..., 0:16]
    return _int4(_shifted_pairs(b[..., 16:80], 2), d * (scales & 0x0F), -(dmin * (scales >> 4)))


def _requantized(qtype: Q, method: str, group: int) -> Callable[[np.ndarray, int], CanonicalMatrix]:
    def transcode(rows: np.ndarray, K: int) -> CanonicalMatrix:
        values = torch.from_numpy(gguf.quants.dequantize(np.ascontiguousarray(rows), qtype))
        return quantize(method, values.reshape(rows.shape[0], K).contiguous(), group)

    return transcode


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


FP16_SCALE = 2**-10  # a sub-block scale (or min) rounded to fp16 once: 2^-11 of it, at most twice
INT8_REQUANTIZED = 1 / 254  # half a step of a symmetric int8 grid over the group's largest value
BF16_ROUNDED = 2**-8

BLOCK_TYPES: dict[Q, BlockType] = {
    Q.Q8_0: BlockType("AMXINT8", 32, 0.0, _q8_0),
    Q.Q5_0: BlockType("AMXINT8", 32, 0.0, _q5_0),
    Q.IQ4_NL: BlockType("AMXINT8", 32, 0.0, _iq4_nl),
    Q.IQ4_XS: BlockType("AMXINT8", 32, FP16_SCALE, _iq4_xs),
    Q.Q6_K: BlockType("AMXINT8", 16, FP16_SCALE, _q6_k),
    Q.Q5_1: BlockType("AMXINT8", 32, INT8_REQUANTIZED, _requantized(Q.Q5_1, "AMXINT8", 32)),
    Q.Q5_K: BlockType("AMXINT8", 32, INT8_REQUANTIZED, _requantized(Q.Q5_K, "AMXINT8", 32)),
    Q.Q4_0: BlockType("AMXINT4", 32, 0.0, _q4_0),
    Q.Q4_1: BlockType("AMXINT4", 32, 0.0, _q4_1),
    Q.Q4_K: BlockType("AMXINT4", 32, FP16_SCALE, _q4_k),
    Q.Q3_K: BlockType("AMXINT4", 16, FP16_SCALE, _q3_k),
    Q.Q2_K: BlockType("AMXINT4", 16, FP16_SCALE, _q2_k),
    Q.MXFP4: BlockType("MXFP4", 32, 0.0, _mxfp4),
    Q.BF16: BlockType("BF16", 64, 0.0, _floats("bf16")),
    Q.F16: BlockType("BF16", 64, BF16_ROUNDED, _floats(np.dtype(np.float16))),
    Q.F32: BlockType("BF16", 64, BF16_ROUNDED, _floats(np.dtype(np.float32))),
}


# Where random blocks (``random_rows``) put their fp16 scales: (byte offset in the block, scale over
# the weights' mean magnitude s) such that the largest |w| is a few times s.
_RANDOM_SCALES = {
    Q.Q8_0: [(0, 1 / 64)],  # w = d * q, |q| <= 127
    Q.Q4_0: [(0, 1 / 4)],  # w = d * (q - 8)
    Q.IQ4_NL: [(0, 1 / 64)],  # w = d * kv, |kv| <= 127
    Q.IQ4_XS: [(0, 1 / 1024)],  # w = d * (ls - 32) * kv
    Q.Q6_K: [(208, 1 / 2048)],  # w = d * sc * (q - 32), sc int8
    Q.Q4_K: [(0, 1 / 128), (2, 1 / 16)],  # w = d * sc * q - dmin * m, sc and m to 63, q to 15
    Q.Q5_K: [(0, 1 / 1024), (2, 1 / 32)],  # the same, q to 31
    Q.Q3_K: [(108, 1 / 64)],  # w = d * (sc - 32) * (q - 4)
    Q.Q2_K: [(80, 1 / 24), (82, 1 / 8)],  # w = d * sc * q - dmin * m, sc and m to 15, q to 3
}


def random_rows(qtype: Q, shape: tuple[int, ...], magnitude: float, seed: int = 0) -> np.ndarray:
    """Random blocks of ``qtype`` for a ``[..., K]`` matrix of weights about ``magnitude`` in size:
    random codes under fixed scales (benchmarks; the types the gguf package cannot quantize)."""
    if qtype not in _RANDOM_SCALES:
        raise ValueError(
            f"no random blocks for {qtype.name}; types: {', '.join(t.name for t in _RANDOM_SCALES)}"
        )
    block, size = GGML_QUANT_SIZES[qtype]
    *lead, K = shape
    b = np.random.default_rng(seed).integers(0, 256, (*lead, K // block, size), dtype=np.uint8)
    for at, factor in _RANDOM_SCALES[qtype]:
        b[..., at : at + 2] = np.array([magnitude * factor], np.float16).view(np.uint8)
    return b.reshape(*lead, -1)
