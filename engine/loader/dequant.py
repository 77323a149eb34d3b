"""Dequantizing GGUF tensor data (ggml block formats) to float32 in torch, vectorized over blocks.

Each format is a fixed-size block of ``type_size`` bytes holding ``block_size`` values along the
innermost (contiguous) dimension. The arithmetic mirrors ``gguf.quants`` (llama.cpp's reference) op for
op in float32, so results are bit-identical to it.

    raw bytes  [n_blocks * type_size]  ->  blocks [n_blocks, type_size] (uint8)  ->  [n_blocks, block_size] f32
"""
from __future__ import annotations

from math import prod
from typing import Callable

import numpy as np
import torch

from engine.errors import ModelLoadError

QK_K = 256


# ---- ggml type ids (ggml.h) ----------------------------------------------------------------------------
class GGMLType:
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


GGML_TYPE_NAMES = {v: k for k, v in vars(GGMLType).items() if not k.startswith("_")}

# type -> (block_size in values, type_size in bytes)
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    GGMLType.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte ``start`` of every block, as float32.  # [n_blocks, 1]"""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _shifts(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split bytes into low then high nibbles per group of ``group`` bytes: [n, k*group] -> [n, k, 2, group]."""
    n = qs.shape[0]
    return (qs.reshape(n, -1, 1, group) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0x0F


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """Four little-endian bytes -> their 32 bits, bit j of the uint32 at column j.  # [n, 32] uint8"""
    n = qh.shape[0]
    return ((qh.reshape(n, 4, 1) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8)) & 1).reshape(n, 32)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte, 6-bit (scale, min) pairs of Q4_K / Q5_K sub-blocks.  # 2 x [n, 8] uint8"""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


# ---- per-format block decoders: [n, type_size] uint8 -> [n, block_size] float32 -------------------------
def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:], 16).reshape(n, 32).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:], 16).reshape(n, 32).to(torch.float32)
    return d * q + m


def _q5(b: torch.Tensor, off: int) -> torch.Tensor:
    n = b.shape[0]
    qh = _bits32(b[:, off:off + 4])
    ql = _nibbles(b[:, off + 4:], 16).reshape(n, 32)
    return ql | (qh << 4)                                    # [n, 32] uint8 in 0..31


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _q5(b, 2).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _q5(b, 4).to(torch.float32)
    return d * q + m


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = (qs.reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    lscales = (scales[:, :8].reshape(n, 1, 8) >> _shifts(0, 4).reshape(1, 2, 1)).reshape(n, 16)
    hscales = (scales[:, 8:].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lscales & 0x0F) | ((hscales & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1))
    qh = (qh.reshape(n, 16, 16) & 1) ^ 1                     # NOTE: the offset is 4 when the mask bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    qh = b[:, 16:48].reshape(n, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
    qh = (qh & 1).reshape(n, 8, 32)
    ql = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _f16(b, 208)
    d = (d * scales.contiguous().view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    ql = _nibbles(ql, 64).reshape(n, 8, 32)
    qh = ((qh.reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (d * q).reshape(n, QK_K)


_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0, GGMLType.Q2_K: _q2_k, GGMLType.Q3_K: _q3_k, GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k, GGMLType.Q6_K: _q6_k,
}
_FLOATS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}

SUPPORTED_TYPES = tuple(GGML_TYPE_NAMES[t] for t in BLOCK_SIZES)

# NOTE: decode large tensors in chunks of blocks so the uint8/int8 temporaries stay cache-friendly and the
# peak memory is the float32 output plus a few MB.
_CHUNK_BLOCKS = 1 << 16


def type_name(ggml_type: int) -> str:
    if int(ggml_type) in GGML_TYPE_NAMES:
        return GGML_TYPE_NAMES[int(ggml_type)]
    try:                                     # names of the types we do not decode (IQ*, TQ*, ...)
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(int(ggml_type)).name
    except (ImportError, ValueError):
        return f"type {int(ggml_type)}"


def dequantize(raw: np.ndarray | bytes | torch.Tensor, ggml_type: int, shape: tuple[int, ...],
               name: str = "<tensor>", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode one GGUF tensor's raw data to float32 (then, chunk by chunk, to ``dtype``).

    Args:
        raw: the tensor's bytes as stored in the file (any dtype view; reinterpreted as uint8).
        ggml_type: the ggml type id (``GGMLType``; ``gguf.GGMLQuantizationType`` values work too).
        shape: the tensor shape in torch order (GGUF ``ne`` reversed); the last dim is the contiguous one.
        name: used in error messages.
        dtype: the output dtype; values are computed in float32 and rounded once, per chunk, so a bf16
            load never holds the whole float32 tensor.

    Returns:
        A new tensor of ``shape`` and ``dtype`` (never sharing memory with ``raw``).
    """
    ggml_type = int(ggml_type)
    if ggml_type not in BLOCK_SIZES:
        raise ModelLoadError(f"tensor {name!r}: unsupported GGUF tensor type {type_name(ggml_type)}; "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")
    data = _as_uint8(raw)
    block_size, type_size = BLOCK_SIZES[ggml_type]
    numel = prod(shape)
    if shape and shape[-1] % block_size:
        raise ModelLoadError(f"tensor {name!r}: row length {shape[-1]} is not a multiple of the "
                             f"{type_name(ggml_type)} block size {block_size}")
    n_blocks = numel // block_size
    if data.numel() != n_blocks * type_size:
        raise ModelLoadError(f"tensor {name!r}: {data.numel()} bytes of {type_name(ggml_type)} data, expected "
                             f"{n_blocks * type_size} for shape {tuple(shape)} (corrupt or truncated file?)")
    if ggml_type in _FLOATS:
        return data.view(_FLOATS[ggml_type]).to(dtype, copy=True).reshape(shape)
    blocks = data.reshape(n_blocks, type_size)
    decode = _DECODERS[ggml_type]
    if n_blocks <= _CHUNK_BLOCKS:
        return decode(blocks).to(dtype).reshape(shape)
    out = torch.empty(n_blocks, block_size, dtype=dtype)
    for start in range(0, n_blocks, _CHUNK_BLOCKS):
        out[start:start + _CHUNK_BLOCKS] = decode(blocks[start:start + _CHUNK_BLOCKS])
    return out.reshape(shape)


# GGUF types whose values are exactly int8 x one float scale per 32-value block (symmetric, no offset): our int8
# format holds them without a float round trip. Q8_0: d * q, q in [-127, 127]; Q5_0: d * (q5 - 16), q5 in 0..31;
# Q4_0: d * (q4 - 8), q4 in 0..15.
EXACT_INT8_TYPES = (GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_0)


def int8_blocks(ggml_type: int, raw: np.ndarray | bytes | torch.Tensor,
                shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 / Q5_0 / Q4_0 tensor as int8 quants [rows, K] and float32 scales [rows, K // 32], no float values:
    ``quants * scale`` is exactly what ``dequantize`` gives (the fp16 ``d`` widened; Q5_0/Q4_0 quants re-centred
    to signed integers, |q| <= 16)."""
    if ggml_type not in EXACT_INT8_TYPES:
        raise ValueError(f"{type_name(ggml_type)} is not a symmetric 32-block type")
    data = _as_uint8(raw)
    rows, k = prod(shape[:-1]), shape[-1]
    blocks = data.reshape(rows * (k // 32), BLOCK_SIZES[ggml_type][1])
    if ggml_type == GGMLType.Q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8)
    elif ggml_type == GGMLType.Q5_0:
        q = _q5(blocks, 2).to(torch.int8) - 16
    else:
        q = _nibbles(blocks[:, 2:], 16).reshape(-1, 32).to(torch.int8) - 8
    return q.reshape(rows, k), _f16(blocks, 0).reshape(rows, k // 32)


def _as_uint8(raw: np.ndarray | bytes | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw.contiguous().view(torch.uint8).reshape(-1)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return torch.frombuffer(bytearray(raw) if isinstance(raw, bytes) else raw, dtype=torch.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if not arr.flags.writeable:     # a read-only memmap: torch wants writable memory; we never write to it
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    return torch.from_numpy(arr)


__all__ = ["GGMLType", "BLOCK_SIZES", "SUPPORTED_TYPES", "dequantize", "EXACT_INT8_TYPES", "int8_blocks",
           "type_name"]
