"""Kernels of the 32-value block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Block layouts are ggml's (``ggml-common.h``). In each block the 16 ``qs`` bytes hold value ``j`` in
the low nibble of byte ``j`` and value ``j + 16`` in its high nibble; Q5 types add bit ``j`` of the
little-endian uint32 ``qh`` as bit 4 of value ``j``. The exact decoders follow gguf-py ``quants.py``
operation by operation (``dequantize_row_q4_0`` etc. in llama.cpp ``ggml-quants.c``).

The fused dot products accumulate unsigned codes and apply the block's affine map once:
``sum_j d * (q_j - 8) * x_j = d * (sum_j q_j x_j - 8 * sum_j x_j)`` (Q4_0; Q5_0 with 16) and
``d * sum_j q_j x_j + m * sum_j x_j`` (Q4_1, Q5_1), with the per-block sums of ``x`` computed once
per call, so the inner loop is one convert and one FMA per weight.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .common import BATCH_ROWS, PREFETCH_ROWS, block_product, f16_at, lshr, prefetch_row, sub_sums
from .simd import dot32_i8_f32, nib32_dot_f32

# ruff: noqa: N803, N806

F32 = np.float32
U8 = np.uint8
U32 = np.uint32
I8 = np.int8

QK = 32
HALF = 16
NIBBLE = U8(0x0F)
NIBBLE_SHIFT = U8(4)

Q4_0_BYTES = 18
Q4_1_BYTES = 20
Q5_0_BYTES = 22
Q5_1_BYTES = 24
Q8_0_BYTES = 34
#: code offsets of the symmetric types: ``q - 8`` (Q4_0), ``q - 16`` (Q5_0)
Q4_0_OFFSET = F32(8.0)
Q5_0_OFFSET = F32(16.0)


@kernel(exact=True, inline=True)
def qh_at(row, o):
    """The little-endian uint32 ``qh`` at byte ``o`` of ``row``."""
    return U32(U32(row[o]) | (U32(row[o + 1]) << U32(8)) | (U32(row[o + 2]) << U32(16)) | (U32(row[o + 3]) << U32(24)))


@kernel(exact=True, inline=True)
def high_bit(qh, j):
    """Bit ``j`` of ``qh`` moved to bit 4 (the fifth bit of a Q5 code), as uint8."""
    return U8((lshr(qh, j) & U32(1)) << U32(4))


# ----------------------------------------------------------------------------------------------
# Q4_0: d f16 @0, qs[16] @2


@kernel(exact=True, inline=True)
def decode_q4_0(row, out):
    """``dequantize_row_q4_0`` (gguf-py ``Q4_0``): ``d * (q - 8)``, bit-exact."""
    n_blocks = out.size // QK
    half = out.size // (2 * n_blocks)
    for b in range(n_blocks):
        o = b * Q4_0_BYTES
        d = f16_at(row, o)
        v = b * QK
        for j in range(half):
            byte = row[o + 2 + j]
            out[v + j] = d * F32(I8(U8(byte & NIBBLE)) - I8(8))
            out[v + HALF + j] = d * F32(I8(U8(byte >> NIBBLE_SHIFT)) - I8(8))


@kernel(inline=True)
def dot_q4_0(row, x, xs):
    """``row . x`` for one Q4_0 row; ``xs``: sums of ``x`` per block."""
    acc = F32(0.0)
    for b in range(x.size // QK):
        o = b * Q4_0_BYTES
        s = nib32_dot_f32(row, o + 2, U32(0), x, b * QK)
        acc += f16_at(row, o) * (s - Q4_0_OFFSET * xs[b])
    return acc


@kernel()
def matvec_q4_0(raw, x, out):
    """``out = W @ x``: ``raw`` ``(rows, row_bytes)`` uint8 Q4_0, ``x`` ``(cols,)``, ``out`` ``(rows,)``."""
    xs = np.empty(x.size // QK, dtype=F32)
    sub_sums(x, QK, xs)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q4_0(raw[r], x, xs)


@kernel()
def matmat_q4_0(raw, xt, out):
    """``out = xt @ W.T``: ``xt`` ``(n, cols)``, ``out`` ``(n, rows)``; each row decoded once."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q4_0(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q4_0(raw, out):
    """Exact dequantization: ``out`` ``(rows, cols)`` float32."""
    for r in range(raw.shape[0]):
        decode_q4_0(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# Q4_1: d f16 @0, m f16 @2, qs[16] @4


@kernel(exact=True, inline=True)
def decode_q4_1(row, out):
    """``dequantize_row_q4_1`` (gguf-py ``Q4_1``): ``(d * q) + m``, bit-exact."""
    n_blocks = out.size // QK
    half = out.size // (2 * n_blocks)
    for b in range(n_blocks):
        o = b * Q4_1_BYTES
        d = f16_at(row, o)
        m = f16_at(row, o + 2)
        v = b * QK
        for j in range(half):
            byte = row[o + 4 + j]
            out[v + j] = d * F32(U8(byte & NIBBLE)) + m
            out[v + HALF + j] = d * F32(U8(byte >> NIBBLE_SHIFT)) + m


@kernel(inline=True)
def dot_q4_1(row, x, xs):
    """``row . x`` for one Q4_1 row; ``xs``: sums of ``x`` per block."""
    acc = F32(0.0)
    for b in range(x.size // QK):
        o = b * Q4_1_BYTES
        s = nib32_dot_f32(row, o + 4, U32(0), x, b * QK)
        acc += f16_at(row, o) * s + f16_at(row, o + 2) * xs[b]
    return acc


@kernel()
def matvec_q4_1(raw, x, out):
    """``out = W @ x`` for a Q4_1 matrix (see :func:`matvec_q4_0`)."""
    xs = np.empty(x.size // QK, dtype=F32)
    sub_sums(x, QK, xs)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q4_1(raw[r], x, xs)


@kernel()
def matmat_q4_1(raw, xt, out):
    """``out = xt @ W.T`` for a Q4_1 matrix (see :func:`matmat_q4_0`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q4_1(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q4_1(raw, out):
    """Exact dequantization of a Q4_1 matrix."""
    for r in range(raw.shape[0]):
        decode_q4_1(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# Q5_0: d f16 @0, qh u32 @2, qs[16] @6


@kernel(exact=True, inline=True)
def decode_q5_0(row, out):
    """``dequantize_row_q5_0`` (gguf-py ``Q5_0``): ``d * (q - 16)``, bit-exact."""
    n_blocks = out.size // QK
    half = out.size // (2 * n_blocks)
    for b in range(n_blocks):
        o = b * Q5_0_BYTES
        d = f16_at(row, o)
        qh = qh_at(row, o + 2)
        v = b * QK
        for j in range(half):
            byte = row[o + 6 + j]
            lo = U8(U8(byte & NIBBLE) | high_bit(qh, j))
            hi = U8(U8(byte >> NIBBLE_SHIFT) | high_bit(qh, j + HALF))
            out[v + j] = d * F32(I8(lo) - I8(16))
            out[v + HALF + j] = d * F32(I8(hi) - I8(16))


@kernel(inline=True)
def dot_q5_0(row, x, xs):
    """``row . x`` for one Q5_0 row; ``xs``: sums of ``x`` per block."""
    acc = F32(0.0)
    for b in range(x.size // QK):
        o = b * Q5_0_BYTES
        s = nib32_dot_f32(row, o + 6, qh_at(row, o + 2), x, b * QK)
        acc += f16_at(row, o) * (s - Q5_0_OFFSET * xs[b])
    return acc


@kernel()
def matvec_q5_0(raw, x, out):
    """``out = W @ x`` for a Q5_0 matrix (see :func:`matvec_q4_0`)."""
    xs = np.empty(x.size // QK, dtype=F32)
    sub_sums(x, QK, xs)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q5_0(raw[r], x, xs)


@kernel()
def matmat_q5_0(raw, xt, out):
    """``out = xt @ W.T`` for a Q5_0 matrix (see :func:`matmat_q4_0`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q5_0(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q5_0(raw, out):
    """Exact dequantization of a Q5_0 matrix."""
    for r in range(raw.shape[0]):
        decode_q5_0(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# Q5_1: d f16 @0, m f16 @2, qh u32 @4, qs[16] @8


@kernel(exact=True, inline=True)
def decode_q5_1(row, out):
    """``dequantize_row_q5_1`` (gguf-py ``Q5_1``): ``(d * q) + m``, bit-exact."""
    n_blocks = out.size // QK
    half = out.size // (2 * n_blocks)
    for b in range(n_blocks):
        o = b * Q5_1_BYTES
        d = f16_at(row, o)
        m = f16_at(row, o + 2)
        qh = qh_at(row, o + 4)
        v = b * QK
        for j in range(half):
            byte = row[o + 8 + j]
            lo = U8(U8(byte & NIBBLE) | high_bit(qh, j))
            hi = U8(U8(byte >> NIBBLE_SHIFT) | high_bit(qh, j + HALF))
            out[v + j] = d * F32(lo) + m
            out[v + HALF + j] = d * F32(hi) + m


@kernel(inline=True)
def dot_q5_1(row, x, xs):
    """``row . x`` for one Q5_1 row; ``xs``: sums of ``x`` per block."""
    acc = F32(0.0)
    for b in range(x.size // QK):
        o = b * Q5_1_BYTES
        s = nib32_dot_f32(row, o + 8, qh_at(row, o + 4), x, b * QK)
        acc += f16_at(row, o) * s + f16_at(row, o + 2) * xs[b]
    return acc


@kernel()
def matvec_q5_1(raw, x, out):
    """``out = W @ x`` for a Q5_1 matrix (see :func:`matvec_q4_0`)."""
    xs = np.empty(x.size // QK, dtype=F32)
    sub_sums(x, QK, xs)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q5_1(raw[r], x, xs)


@kernel()
def matmat_q5_1(raw, xt, out):
    """``out = xt @ W.T`` for a Q5_1 matrix (see :func:`matmat_q4_0`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q5_1(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q5_1(raw, out):
    """Exact dequantization of a Q5_1 matrix."""
    for r in range(raw.shape[0]):
        decode_q5_1(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# Q8_0: d f16 @0, qs int8[32] @2


@kernel(exact=True, inline=True)
def decode_q8_0(row, out):
    """``dequantize_row_q8_0`` (gguf-py ``Q8_0``): ``q * d``, bit-exact."""
    n_blocks = out.size // QK
    size = out.size // n_blocks
    for b in range(n_blocks):
        o = b * Q8_0_BYTES
        d = f16_at(row, o)
        v = b * QK
        for j in range(size):
            out[v + j] = F32(I8(row[o + 2 + j])) * d


@kernel(inline=True)
def dot_q8_0(row, x):
    """``row . x`` for one Q8_0 row."""
    acc = F32(0.0)
    for b in range(x.size // QK):
        o = b * Q8_0_BYTES
        acc += f16_at(row, o) * dot32_i8_f32(row, o + 2, x, b * QK)
    return acc


@kernel()
def matvec_q8_0(raw, x, out):
    """``out = W @ x`` for a Q8_0 matrix (see :func:`matvec_q4_0`)."""
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q8_0(raw[r], x)


@kernel()
def matmat_q8_0(raw, xt, out):
    """``out = xt @ W.T`` for a Q8_0 matrix (see :func:`matmat_q4_0`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q8_0(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q8_0(raw, out):
    """Exact dequantization of a Q8_0 matrix."""
    for r in range(raw.shape[0]):
        decode_q8_0(raw[r], out[r])
