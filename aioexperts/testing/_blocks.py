"""Realistic quantized blocks for synthetic models: quantize a small pool once, then tile it.

A synthetic tensor of millions of blocks is made of blocks drawn at random from a pool of
:data:`POOL_BLOCKS` blocks, each the quantization of zero-mean unit-variance normal data, with
every block's scale fields multiplied by ``target_std`` times a random factor (so no two 4 KiB
regions of the file are alike, and the weights have the wanted standard deviation). Quantizing
2.7 GB of floats would take minutes; drawing from the pool takes seconds.

The pool comes from ``gguf.quants.quantize`` for the types gguf-py can quantize, and from
:func:`quantize_q4_k` (a simple scale/min quantizer in llama.cpp's ``block_q4_K`` layout) for
``Q4_K``. Other types return None: the caller falls back to random bytes.
"""

from __future__ import annotations

import functools

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ("POOL_BLOCKS", "draw_blocks", "quantize_q4_k", "quantized_pool")

Q = GGMLQuantizationType
#: Blocks in one pool.
POOL_BLOCKS = 8192
#: Types whose pool comes from ``gguf.quants.quantize``.
_GGUF_QUANTIZABLE = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4})
#: Byte offsets of the f16 scale fields of one block, multiplied together to scale the weights.
_F16_SCALES: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q2_K: (80, 82),  # block_q2_K: scales[16], qs[64], d, dmin
}
_MXFP4_EXPONENT = 0  # byte offset of the e8m0 shared exponent of an MXFP4 block


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Quantize float32 rows of 256 values to ``Q4_K`` blocks (``d * sc * q - dmin * m``).

    Per sub-block of 32 values: the range ``[-min, max]`` is cut into 15 steps; the 8 step sizes
    and 8 minima of a block are stored as 6-bit multiples of the f16 ``d`` and ``dmin``. Simpler
    than llama.cpp's iterative ``make_qkx2_quants``, with the same layout and the same kind of
    error (a zero-mean input gives zero-mean weights).

    Args:
        x: float32 ``(n_blocks, 256)``.

    Returns:
        uint8 ``(n_blocks, 144)``: ``d``, ``dmin`` (f16), 12 bytes of packed scales and mins,
        128 bytes of 4-bit codes.
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1, 8, 32)
    n = len(x)
    minimum = np.maximum(-x.min(axis=2), 0.0)  # (n, 8), the offset subtracted back
    step = (x.max(axis=2) + minimum) / 15.0
    d = (step.max(axis=1) / 63.0).astype(np.float16)
    dmin = (minimum.max(axis=1) / 63.0).astype(np.float16)
    d32 = np.where(d > 0, d.astype(np.float32), 1.0)
    dmin32 = np.where(dmin > 0, dmin.astype(np.float32), 1.0)
    sc = np.clip(np.rint(step / d32[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(minimum / dmin32[:, None]), 0, 63).astype(np.uint8)
    real_step = (d32[:, None] * sc)[:, :, None]
    real_min = (dmin32[:, None] * mn)[:, :, None]
    q = np.clip(np.rint((x + real_min) / real_step), 0, 15).astype(np.uint8)
    out = np.zeros((n, 144), dtype=np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    scales = out[:, 4:16]
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    codes = q.reshape(n, 4, 2, 32)  # chunk c holds sub-blocks 2c (low nibble) and 2c + 1 (high)
    out[:, 16:144] = (codes[:, :, 0, :] | (codes[:, :, 1, :] << 4)).reshape(n, 128)
    return out


@functools.cache
def quantized_pool(ggml_type: GGMLQuantizationType, seed: int = 0) -> np.ndarray | None:
    """:data:`POOL_BLOCKS` blocks quantized from N(0, 1) data, uint8 ``(POOL_BLOCKS, type_size)``.

    Returns:
        The pool (read-only), or None for a type this module cannot quantize.
    """
    if ggml_type == Q.Q2_K:
        return _q2_k_pool(seed)
    if ggml_type not in _GGUF_QUANTIZABLE and ggml_type != Q.Q4_K:
        return None
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    data = np.random.default_rng(seed).standard_normal((POOL_BLOCKS, block_size), dtype=np.float32)
    if ggml_type == Q.Q4_K:
        pool = quantize_q4_k(data)
    else:
        pool = np.ascontiguousarray(gguf.quants.quantize(data, ggml_type)).view(np.uint8)
    pool = pool.reshape(POOL_BLOCKS, type_size)
    pool.flags.writeable = False
    return pool


def _q2_k_pool(seed: int) -> np.ndarray:
    """Q2_K blocks of random scales and 2-bit quants, ``d`` and ``dmin`` set so the weights have mean
    about 0 and standard deviation about 1 (``x = d * scale * q - dmin * min``)."""
    _, type_size = GGML_QUANT_SIZES[Q.Q2_K]
    pool = np.random.default_rng(seed).integers(0, 256, (POOL_BLOCKS, type_size), dtype=np.uint8)
    # scale * q averages 7.5 * 1.5 and min 7.5: dmin = 1.5 d centres the weights
    fields = np.array([1.0, 1.5], dtype=np.float16).view(np.uint8)
    pool[:, 80:84] = fields
    values = gguf.quants.dequantize(pool, Q.Q2_K)
    std = float(np.std(values))
    pool[:, 80:84] = (np.array([1.0, 1.5], dtype=np.float32) / std).astype(np.float16).view(np.uint8)
    pool.flags.writeable = False
    return pool


def draw_blocks(
    rng: np.random.Generator, ggml_type: GGMLQuantizationType, n_blocks: int, target_std: float
) -> np.ndarray | None:
    """``n_blocks`` blocks drawn from the pool, scaled so the weights' std is about ``target_std``.

    Each block's scale fields are multiplied by ``target_std`` times a factor drawn uniformly
    from [0.8, 1.25] (for MXFP4, a power of two near ``target_std``, plus or minus one).

    Returns:
        uint8 ``(n_blocks, type_size)``, or None for a type without a pool.
    """
    pool = quantized_pool(ggml_type)
    if pool is None:
        return None
    blocks = pool[rng.integers(0, len(pool), n_blocks)]
    if ggml_type == Q.MXFP4:
        shift = int(np.rint(np.log2(target_std))) + rng.integers(-1, 2, n_blocks)
        exponent = blocks[:, _MXFP4_EXPONENT].astype(np.int32) + shift
        blocks[:, _MXFP4_EXPONENT] = np.clip(exponent, 1, 254).astype(np.uint8)
        return blocks
    factor = (rng.uniform(0.8, 1.25, n_blocks) * target_std).astype(np.float32)
    for offset in _F16_SCALES[ggml_type]:
        field = np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16)[:, 0]
        scaled = (field.astype(np.float32) * factor).astype(np.float16)
        blocks[:, offset : offset + 2] = scaled.view(np.uint8).reshape(-1, 2)
    return blocks
