"""Kernels of the 4-bit codebook types: IQ4_NL, IQ4_XS and MXFP4.

Each 4-bit code indexes a 16-entry table of small integers (``kvalues_iq4nl``, ``kvalues_mxfp4``
in llama.cpp ``ggml-common.h``), scaled per block (IQ4_NL: f16 ``d``; IQ4_XS: ``d * (sc - 32)`` per
32-value sub-block; MXFP4: the e8m0 exponent, ``ggml_e8m0_to_fp32_half``). The exact decoders follow
gguf-py ``quants.py`` (``dequantize_row_iq4_nl``, ``dequantize_row_iq4_xs``,
``dequantize_row_mxfp4``). The fused products look the table up 16 codes at a time with a byte
shuffle (:func:`.simd.make_lut_dots`: ``pshufb``/``tbl``); written as plain array indexing, the
lookups become gathers, 3-7x slower (docs/notes/KERNELS.md, pitfall 7). The exact decoders index the table.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .common import BATCH_ROWS, PREFETCH_ROWS, block_product, e8m0_half, f16_at, prefetch_row
from .simd import make_lut_dots

# ruff: noqa: N803, N806

F32 = np.float32
U8 = np.uint8
I8 = np.int8

QK = 32
QK_K = 256
HALF = 16
NIBBLE = U8(0x0F)
NIBBLE_SHIFT = U8(4)

#: ``kvalues_iq4nl`` as float32 (exact: small integers)
KVALUES_IQ4 = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), dtype=F32)
#: ``kvalues_mxfp4``: e2m1 values doubled, as float32
KVALUES_MXFP4 = np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), dtype=F32)

iq4_dot_f32, _ = make_lut_dots(tuple(int(v) for v in KVALUES_IQ4))
mxfp4_dot_f32, _ = make_lut_dots(tuple(int(v) for v in KVALUES_MXFP4))

IQ4_NL_BYTES = 18
MXFP4_BYTES = 17
IQ4_XS_BYTES = 136
IQ4_XS_QS = 8


# ----------------------------------------------------------------------------------------------
# IQ4_NL: d f16 @0, qs[16] @2


@kernel(exact=True, inline=True)
def decode_iq4_nl(row, out):
    """``dequantize_row_iq4_nl`` (gguf-py ``IQ4_NL``): ``d * kvalues[q]``, bit-exact."""
    n_blocks = out.size // QK
    half = out.size // (2 * n_blocks)
    for b in range(n_blocks):
        o = b * IQ4_NL_BYTES
        d = f16_at(row, o)
        v = b * QK
        for j in range(half):
            byte = row[o + 2 + j]
            out[v + j] = d * KVALUES_IQ4[byte & NIBBLE]
            out[v + HALF + j] = d * KVALUES_IQ4[byte >> NIBBLE_SHIFT]


@kernel(inline=True)
def dot_iq4_nl(row, x):
    """``row . x`` for one IQ4_NL row."""
    acc = F32(0.0)
    for b in range(x.size // QK):
        o = b * IQ4_NL_BYTES
        acc += f16_at(row, o) * iq4_dot_f32(row, o + 2, x, b * QK)
    return acc


@kernel()
def matvec_iq4_nl(raw, x, out):
    """``out = W @ x``: ``raw`` ``(rows, row_bytes)`` uint8 IQ4_NL, ``x`` ``(cols,)``, ``out`` ``(rows,)``."""
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_iq4_nl(raw[r], x)


@kernel()
def matmat_iq4_nl(raw, xt, out):
    """``out = xt @ W.T``: ``xt`` ``(n, cols)``, ``out`` ``(n, rows)``; each row decoded once."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_iq4_nl(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_iq4_nl(raw, out):
    """Exact dequantization of an IQ4_NL matrix."""
    for r in range(raw.shape[0]):
        decode_iq4_nl(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# MXFP4: e (e8m0 exponent) @0, qs[16] @1


@kernel(exact=True, inline=True)
def decode_mxfp4(row, out):
    """``dequantize_row_mxfp4`` (gguf-py ``MXFP4``): ``e8m0_half(e) * kvalues[q]``, bit-exact."""
    n_blocks = out.size // QK
    half = out.size // (2 * n_blocks)
    for b in range(n_blocks):
        o = b * MXFP4_BYTES
        d = e8m0_half(row[o])
        v = b * QK
        for j in range(half):
            byte = row[o + 1 + j]
            out[v + j] = d * KVALUES_MXFP4[byte & NIBBLE]
            out[v + HALF + j] = d * KVALUES_MXFP4[byte >> NIBBLE_SHIFT]


@kernel(inline=True)
def dot_mxfp4(row, x):
    """``row . x`` for one MXFP4 row."""
    acc = F32(0.0)
    for b in range(x.size // QK):
        o = b * MXFP4_BYTES
        acc += e8m0_half(row[o]) * mxfp4_dot_f32(row, o + 1, x, b * QK)
    return acc


@kernel()
def matvec_mxfp4(raw, x, out):
    """``out = W @ x`` for an MXFP4 matrix (see :func:`matvec_iq4_nl`)."""
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_mxfp4(raw[r], x)


@kernel()
def matmat_mxfp4(raw, xt, out):
    """``out = xt @ W.T`` for an MXFP4 matrix (see :func:`matmat_iq4_nl`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_mxfp4(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_mxfp4(raw, out):
    """Exact dequantization of an MXFP4 matrix."""
    for r in range(raw.shape[0]):
        decode_mxfp4(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# IQ4_XS: d f16 @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8. Sub-block j (32 values) has the
# 6-bit scale (scales_l[j // 2] >> 4(j % 2)) & 15 | ((scales_h >> 2j) & 3) << 4, minus 32, and
# its codes in qs[16j:16j + 16] laid out like one IQ4_NL block.


@kernel(exact=True, inline=True)
def scale_iq4_xs(row, o, j):
    """The scale of sub-block ``j`` of the IQ4_XS block at ``o``, minus 32, as float32."""
    low = U8((row[o + 4 + j // 2] >> U8(4 * (j % 2))) & NIBBLE)
    high_byte = row[o + 2 + j // 4]  # scales_h is little-endian: sub-blocks 0-3 in byte 0
    high = U8((high_byte >> U8(2 * (j % 4))) & U8(3))
    return F32(I8(U8(low | U8(high << U8(4)))) - I8(32))


@kernel(exact=True, inline=True)
def decode_iq4_xs(row, out):
    """``dequantize_row_iq4_xs`` (gguf-py ``IQ4_XS``): ``(d * (sc - 32)) * kvalues[q]``, bit-exact."""
    n_blocks = out.size // QK_K
    half = out.size // (n_blocks * 16)  # 16
    for b in range(n_blocks):
        o = b * IQ4_XS_BYTES
        d = f16_at(row, o)
        for j in range(8):
            dl = d * scale_iq4_xs(row, o, j)
            q = o + IQ4_XS_QS + 16 * j
            v = b * QK_K + 32 * j
            for i in range(half):
                byte = row[q + i]
                out[v + i] = dl * KVALUES_IQ4[byte & NIBBLE]
                out[v + HALF + i] = dl * KVALUES_IQ4[byte >> NIBBLE_SHIFT]


@kernel(inline=True)
def dot_iq4_xs(row, x):
    """``row . x`` for one IQ4_XS row."""
    acc = F32(0.0)
    for b in range(x.size // QK_K):
        o = b * IQ4_XS_BYTES
        block = F32(0.0)
        for j in range(8):
            block += scale_iq4_xs(row, o, j) * iq4_dot_f32(row, o + IQ4_XS_QS + 16 * j, x, b * QK_K + 32 * j)
        acc += f16_at(row, o) * block
    return acc


@kernel()
def matvec_iq4_xs(raw, x, out):
    """``out = W @ x`` for an IQ4_XS matrix (see :func:`matvec_iq4_nl`)."""
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_iq4_xs(raw[r], x)


@kernel()
def matmat_iq4_xs(raw, xt, out):
    """``out = xt @ W.T`` for an IQ4_XS matrix (see :func:`matmat_iq4_nl`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_iq4_xs(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_iq4_xs(raw, out):
    """Exact dequantization of an IQ4_XS matrix."""
    for r in range(raw.shape[0]):
        decode_iq4_xs(raw[r], out[r])
