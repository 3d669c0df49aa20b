"""k-quant kernels (256-value super-blocks): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Block layouts are ggml's (``ggml-common.h``); the exact decoders follow gguf-py ``quants.py``
operation by operation (itself a port of llama.cpp ``dequantize_row_*``). The fused dot products
factor the scales out of each sub-block: ``sum_i d * sc * q_i * x_i - dmin * m * x_i`` becomes
``d * sc * sum_i q_i x_i - dmin * m * sum_i x_i`` with the sums of ``x`` per sub-block computed once
per call (``ggml_vec_dot_*_q8_K`` does the same with ``bsums``, on quantized ``x``).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .common import BATCH_ROWS, PREFETCH_ROWS, block_product, f16_at, lshr, prefetch_row, sub_sums
from .simd import dot32_f32_scaled

# ruff: noqa: N803, N806

F32 = np.float32
U8 = np.uint8
U32 = np.uint32
I8 = np.int8
I32 = np.int32

QK_K = 256

# ----------------------------------------------------------------------------------------------
# Q4_K: d f16 @0, dmin f16 @2, 12 bytes of packed 6-bit scales and mins @4, 128 qs @16.
# 8 sub-blocks of 32: sub-block 2c holds the low nibbles of qs[32c:32c+32], 2c+1 the high ones.

Q4_K_BYTES = 144
Q4_K_QS = 16


@kernel(exact=True, inline=True)
def scale_min_k4(row, o, j):
    """``get_scale_min_k4``: the 6-bit scale and min of sub-block ``j`` of the Q4_K/Q5_K block at ``o``."""
    s = o + 4
    if j < 4:
        return U8(row[s + j] & U8(63)), U8(row[s + j + 4] & U8(63))
    sc = (row[s + j + 4] & U8(0x0F)) | ((row[s + j - 4] >> U8(6)) << U8(4))
    mn = (row[s + j + 4] >> U8(4)) | ((row[s + j] >> U8(6)) << U8(4))
    return U8(sc), U8(mn)


@kernel(exact=True, inline=True)
def decode_q4_k(row, out):
    """``dequantize_row_q4_K`` (gguf-py ``Q4_K``): ``(d * sc) * q - (dmin * m)``, bit-exact."""
    n_blocks = out.size // QK_K
    sub = out.size // (n_blocks * 8)  # 32, from the shape so LLVM does not unroll it
    for b in range(n_blocks):
        o = b * Q4_K_BYTES
        d = f16_at(row, o)
        dmin = f16_at(row, o + 2)
        for j in range(8):
            sc, mn = scale_min_k4(row, o, j)
            dl = d * F32(sc)
            ml = dmin * F32(mn)
            q = o + Q4_K_QS + 32 * (j // 2)
            shift = U8(4 * (j % 2))
            v = b * QK_K + 32 * j
            for lane in range(sub):
                out[v + lane] = dl * F32(U8(lshr(row[q + lane], shift) & U8(0x0F))) - ml


@kernel(inline=True)
def dot_q4_k(row, x, xs):
    """``row . x`` for one Q4_K row; ``xs``: sums of ``x`` over each 32-value sub-block."""
    n_blocks = x.size // QK_K
    acc = F32(0.0)
    for b in range(n_blocks):
        o = b * Q4_K_BYTES
        d = f16_at(row, o)
        dmin = f16_at(row, o + 2)
        block = F32(0.0)
        mins = F32(0.0)
        for c in range(4):
            sc0, m0 = scale_min_k4(row, o, 2 * c)
            sc1, m1 = scale_min_k4(row, o, 2 * c + 1)
            q = o + Q4_K_QS + 32 * c
            xb = b * QK_K + 64 * c
            lo = F32(0.0)
            hi = F32(0.0)
            for lane in range(32):
                v = row[q + lane]
                lo += F32(U8(v & U8(0x0F))) * x[xb + lane]
                hi += F32(U8(v >> U8(4))) * x[xb + 32 + lane]
            block += F32(sc0) * lo + F32(sc1) * hi
            mins += F32(m0) * xs[b * 8 + 2 * c] + F32(m1) * xs[b * 8 + 2 * c + 1]
        acc += d * block - dmin * mins
    return acc


@kernel()
def matvec_q4_k(raw, x, out):
    """``out = W @ x``: ``raw`` ``(rows, row_bytes)`` uint8 Q4_K, ``x`` ``(cols,)``, ``out`` ``(rows,)`` float32."""
    xs = np.empty(x.size // 32, dtype=F32)
    sub_sums(x, 32, xs)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q4_k(raw[r], x, xs)


@kernel()
def matmat_q4_k(raw, xt, out):
    """``out = xt @ W.T``: ``xt`` ``(n, cols)``, ``out`` ``(n, rows)`` float32; each row decoded once."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q4_k(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q4_k(raw, out):
    """Exact dequantization of every row: ``out`` ``(rows, cols)`` float32."""
    for r in range(raw.shape[0]):
        decode_q4_k(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# Q5_K: d f16 @0, dmin f16 @2, 12 bytes of scales and mins @4, qh[32] @16, qs[128] @48.
# Sub-block j: low 4 bits as Q4_K, bit 4 = bit j of qh[l].

Q5_K_BYTES = 176
Q5_K_QH = 16
Q5_K_QS = 48


@kernel(exact=True, inline=True)
def decode_q5_k(row, out):
    """``dequantize_row_q5_K`` (gguf-py ``Q5_K``): ``(d * sc) * q - (dmin * m)``, 5-bit q, bit-exact."""
    n_blocks = out.size // QK_K
    sub = out.size // (n_blocks * 8)
    for b in range(n_blocks):
        o = b * Q5_K_BYTES
        d = f16_at(row, o)
        dmin = f16_at(row, o + 2)
        for j in range(8):
            sc, mn = scale_min_k4(row, o, j)
            dl = d * F32(sc)
            ml = dmin * F32(mn)
            q = o + Q5_K_QS + 32 * (j // 2)
            shift = U8(4 * (j % 2))
            v = b * QK_K + 32 * j
            for lane in range(sub):
                code = U8(lshr(row[q + lane], shift) & U8(0x0F)) | U8(
                    (lshr(row[o + Q5_K_QH + lane], j) & U8(1)) << U8(4)
                )
                out[v + lane] = dl * F32(U8(code)) - ml


@kernel(inline=True)
def dot_q5_k(row, x, xs):
    """``row . x`` for one Q5_K row; ``xs``: sums of ``x`` over each 32-value sub-block."""
    n_blocks = x.size // QK_K
    acc = F32(0.0)
    for b in range(n_blocks):
        o = b * Q5_K_BYTES
        d = f16_at(row, o)
        dmin = f16_at(row, o + 2)
        block = F32(0.0)
        mins = F32(0.0)
        for c in range(4):
            sc0, m0 = scale_min_k4(row, o, 2 * c)
            sc1, m1 = scale_min_k4(row, o, 2 * c + 1)
            q = o + Q5_K_QS + 32 * c
            xb = b * QK_K + 64 * c
            b0 = U8(2 * c)
            b1 = U8(2 * c + 1)
            lo = F32(0.0)
            hi = F32(0.0)
            for lane in range(32):
                v = row[q + lane]
                h = row[o + Q5_K_QH + lane]
                lo += F32(U8(U8(v & U8(0x0F)) | U8((lshr(h, b0) & U8(1)) << U8(4)))) * x[xb + lane]
                hi += F32(U8(U8(v >> U8(4)) | U8((lshr(h, b1) & U8(1)) << U8(4)))) * x[xb + 32 + lane]
            block += F32(sc0) * lo + F32(sc1) * hi
            mins += F32(m0) * xs[b * 8 + 2 * c] + F32(m1) * xs[b * 8 + 2 * c + 1]
        acc += d * block - dmin * mins
    return acc


@kernel()
def matvec_q5_k(raw, x, out):
    """``out = W @ x`` for a Q5_K matrix (see :func:`matvec_q4_k`)."""
    xs = np.empty(x.size // 32, dtype=F32)
    sub_sums(x, 32, xs)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q5_k(raw[r], x, xs)


@kernel()
def matmat_q5_k(raw, xt, out):
    """``out = xt @ W.T`` for a Q5_K matrix (see :func:`matmat_q4_k`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q5_k(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q5_k(raw, out):
    """Exact dequantization of a Q5_K matrix."""
    for r in range(raw.shape[0]):
        decode_q5_k(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# Q6_K: ql[128] @0, qh[64] @128, int8 scales[16] @192, d f16 @208. Value 128n + 32j + l
# (n < 2, j < 4, l < 32): low 4 bits from ql[64n + 32(j % 2) + l] >> 4(j // 2), high 2 bits from
# qh[32n + l] >> 2j; minus 32; sub-block of 16 = 8n + 2j + l // 16.

Q6_K_BYTES = 210
Q6_K_QH = 128
Q6_K_SCALES = 192
Q6_K_D = 208
Q6_K_OFFSET = F32(32.0)


@kernel(exact=True, inline=True)
def decode_q6_k(row, out):
    """``dequantize_row_q6_K`` (gguf-py ``Q6_K``): ``(d * sc) * (q - 32)``, bit-exact."""
    n_blocks = out.size // QK_K
    half = out.size // (n_blocks * 16)  # 16
    for b in range(n_blocks):
        o = b * Q6_K_BYTES
        d = f16_at(row, o + Q6_K_D)
        for n in range(2):
            for j in range(4):
                ql = o + 64 * n + 32 * (j % 2)
                shift = U8(4 * (j // 2))
                qh = o + Q6_K_QH + 32 * n
                hshift = U8(2 * j)
                for s in range(2):
                    sb = 8 * n + 2 * j + s
                    dl = d * F32(I8(row[o + Q6_K_SCALES + sb]))
                    v = b * QK_K + 128 * n + 32 * j + 16 * s
                    for i in range(half):
                        lane = 16 * s + i
                        code = U8(lshr(row[ql + lane], shift) & U8(0x0F)) | U8(
                            (lshr(row[qh + lane], hshift) & U8(3)) << U8(4)
                        )
                        out[v + i] = dl * F32(I8(code) - I8(32))


@kernel(inline=True)
def dot_q6_k(row, x, xs):
    """``row . x`` for one Q6_K row; ``xs``: sums of ``x`` over each 16-value sub-block."""
    acc = F32(0.0)
    for b in range(x.size // QK_K):
        o = b * Q6_K_BYTES
        sc = o + Q6_K_SCALES
        offset = F32(0.0)
        for sb in range(16):
            offset += F32(I8(row[sc + sb])) * xs[b * 16 + sb]
        block = -Q6_K_OFFSET * offset
        for n in range(2):
            ql = o + 64 * n
            qh = o + Q6_K_QH + 32 * n
            xb = b * QK_K + 128 * n
            for j in range(4):
                sb = sc + 8 * n + 2 * j
                block += dot32_f32_scaled(
                    row, ql + 32 * (j % 2), U8(4 * (j // 2)), U8(0x0F), qh, U8(2 * j), U8(3), U8(4),
                    x, xb + 32 * j, F32(I8(row[sb])), F32(I8(row[sb + 1])),
                )  # fmt: skip
        acc += f16_at(row, o + Q6_K_D) * block
    return acc


@kernel()
def matvec_q6_k(raw, x, out):
    """``out = W @ x`` for a Q6_K matrix (see :func:`matvec_q4_k`)."""
    xs = np.empty(x.size // 16, dtype=F32)
    sub_sums(x, 16, xs)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q6_k(raw[r], x, xs)


@kernel()
def matmat_q6_k(raw, xt, out):
    """``out = xt @ W.T`` for a Q6_K matrix (see :func:`matmat_q4_k`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q6_k(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q6_k(raw, out):
    """Exact dequantization of a Q6_K matrix."""
    for r in range(raw.shape[0]):
        decode_q6_k(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# Q2_K: scales[16] @0 (low nibble scale, high nibble min), qs[64] @16, d f16 @80, dmin f16 @82.
# Value 128n + 32j + l: (qs[32n + l] >> 2j) & 3; sub-block of 16 = 8n + 2j + l // 16.

Q2_K_BYTES = 84
Q2_K_QS = 16
Q2_K_D = 80


@kernel(exact=True, inline=True)
def decode_q2_k(row, out):
    """``dequantize_row_q2_K`` (gguf-py ``Q2_K``): ``(d * (sc & 15)) * q - (dmin * (sc >> 4))``."""
    n_blocks = out.size // QK_K
    half = out.size // (n_blocks * 16)  # 16
    for b in range(n_blocks):
        o = b * Q2_K_BYTES
        d = f16_at(row, o + Q2_K_D)
        dmin = f16_at(row, o + Q2_K_D + 2)
        for n in range(2):
            for j in range(4):
                shift = U8(2 * j)
                for s in range(2):
                    sb = 8 * n + 2 * j + s
                    scale = row[o + sb]
                    dl = d * F32(U8(scale & U8(0x0F)))
                    ml = dmin * F32(U8(scale >> U8(4)))
                    q = o + Q2_K_QS + 32 * n + 16 * s
                    v = b * QK_K + 128 * n + 32 * j + 16 * s
                    for i in range(half):
                        out[v + i] = dl * F32(U8(lshr(row[q + i], shift) & U8(3))) - ml


@kernel(inline=True)
def dot_q2_k(row, x, xs):
    """``row . x`` for one Q2_K row; ``xs``: sums of ``x`` over each 16-value sub-block."""
    acc = F32(0.0)
    for b in range(x.size // QK_K):
        o = b * Q2_K_BYTES
        mins = F32(0.0)
        for sb in range(16):
            mins += F32(U8(row[o + sb] >> U8(4))) * xs[b * 16 + sb]
        block = F32(0.0)
        for n in range(2):
            qs = o + Q2_K_QS + 32 * n
            xb = b * QK_K + 128 * n
            for j in range(4):
                sb = o + 8 * n + 2 * j
                block += dot32_f32_scaled(
                    row, qs, U8(2 * j), U8(3), qs, U8(0), U8(0), U8(0), x, xb + 32 * j,
                    F32(U8(row[sb] & U8(0x0F))), F32(U8(row[sb + 1] & U8(0x0F))),
                )  # fmt: skip
        acc += f16_at(row, o + Q2_K_D) * block - f16_at(row, o + Q2_K_D + 2) * mins
    return acc


@kernel()
def matvec_q2_k(raw, x, out):
    """``out = W @ x`` for a Q2_K matrix (see :func:`matvec_q4_k`)."""
    xs = np.empty(x.size // 16, dtype=F32)
    sub_sums(x, 16, xs)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q2_k(raw[r], x, xs)


@kernel()
def matmat_q2_k(raw, xt, out):
    """``out = xt @ W.T`` for a Q2_K matrix (see :func:`matmat_q4_k`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q2_k(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q2_k(raw, out):
    """Exact dequantization of a Q2_K matrix."""
    for r in range(raw.shape[0]):
        decode_q2_k(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# Q3_K: hmask[32] @0, qs[64] @32, 12 bytes of packed 6-bit scales @96, d f16 @108.
# Value 128n + 32j + l: low 2 bits (qs[32n + l] >> 2j) & 3, minus 4 unless bit 4n + j of hmask[l]
# is set; sub-block of 16 = 8n + 2j + l // 16; scale i (6 bits) = low nibble of byte i % 8
# (>> 4 for i >= 8) | 2 bits of byte 8 + i % 4 (>> 2 * (i // 4)) << 4, minus 32.

Q3_K_BYTES = 110
Q3_K_QS = 32
Q3_K_SCALES = 96
Q3_K_D = 108
Q3_K_OFFSET = F32(4.0)


@kernel(exact=True, inline=True)
def scale_q3_k(row, o, i):
    """The 6-bit scale ``i`` (0..15) of the Q3_K block at ``o``, minus 32, as float32."""
    s = o + Q3_K_SCALES
    low = U8((row[s + i % 8] >> U8(4 * (i // 8))) & U8(0x0F))
    high = U8((row[s + 8 + i % 4] >> U8(2 * (i // 4))) & U8(3))
    return F32(I8(U8(low | U8(high << U8(4)))) - I8(32))


@kernel(inline=True)
def q3_k_scale_words(row, s):
    """The 16 6-bit scales of the Q3_K block whose scales start at ``s``, as 4 uint32 of 4 bytes.

    ``aux`` of ``ggml_vec_dot_q3_K_q8_K``: byte ``i`` of the result (little-endian) is scale ``i``
    (before subtracting 32). Four word operations instead of sixteen byte extractions.
    """
    a0 = U32(row[s]) | (U32(row[s + 1]) << U32(8)) | (U32(row[s + 2]) << U32(16)) | (U32(row[s + 3]) << U32(24))
    a1 = U32(row[s + 4]) | (U32(row[s + 5]) << U32(8)) | (U32(row[s + 6]) << U32(16)) | (U32(row[s + 7]) << U32(24))
    hi = U32(row[s + 8]) | (U32(row[s + 9]) << U32(8)) | (U32(row[s + 10]) << U32(16)) | (U32(row[s + 11]) << U32(24))
    low4 = U32(0x0F0F_0F0F)
    two = U32(0x0303_0303)
    w0 = U32((a0 & low4) | ((hi & two) << U32(4)))
    w1 = U32((a1 & low4) | (((hi >> U32(2)) & two) << U32(4)))
    w2 = U32(((a0 >> U32(4)) & low4) | (((hi >> U32(4)) & two) << U32(4)))
    w3 = U32(((a1 >> U32(4)) & low4) | (((hi >> U32(6)) & two) << U32(4)))
    return w0, w1, w2, w3


@kernel(exact=True, inline=True)
def decode_q3_k(row, out):
    """``dequantize_row_q3_K`` (gguf-py ``Q3_K``): ``(d * (sc - 32)) * (q - 4 * !hbit)``."""
    n_blocks = out.size // QK_K
    half = out.size // (n_blocks * 16)  # 16
    for b in range(n_blocks):
        o = b * Q3_K_BYTES
        d = f16_at(row, o + Q3_K_D)
        for n in range(2):
            for j in range(4):
                shift = U8(2 * j)
                hbit = U8(4 * n + j)
                for s in range(2):
                    sb = 8 * n + 2 * j + s
                    dl = d * scale_q3_k(row, o, sb)
                    q = o + Q3_K_QS + 32 * n + 16 * s
                    h = o + 16 * s
                    v = b * QK_K + 128 * n + 32 * j + 16 * s
                    for i in range(half):
                        low = I8(U8(lshr(row[q + i], shift) & U8(3)))
                        minus = I8(U8((U8(lshr(row[h + i], hbit) & U8(1)) ^ U8(1)) << U8(2)))
                        out[v + i] = dl * F32(low - minus)


@kernel(inline=True)
def dot_q3_k(row, x, xs):
    """``row . x`` for one Q3_K row; ``xs``: sums of ``x`` over each 16-value sub-block."""
    acc = F32(0.0)
    for b in range(x.size // QK_K):
        o = b * Q3_K_BYTES
        w0, w1, w2, w3 = q3_k_scale_words(row, o + Q3_K_SCALES)
        block = F32(0.0)
        for n in range(2):
            qs = o + Q3_K_QS + 32 * n
            xb = b * QK_K + 128 * n
            word_a = w0 if n == 0 else w2
            word_b = w1 if n == 0 else w3
            for j in range(4):
                word = word_a if j < 2 else word_b
                shift = U32(16 * (j % 2))
                s0 = F32(I32((word >> shift) & U32(0xFF)) - I32(32))
                s1 = F32(I32((word >> (shift + U32(8))) & U32(0xFF)) - I32(32))
                k = b * 16 + 8 * n + 2 * j
                block += dot32_f32_scaled(
                    row, qs, U8(2 * j), U8(3), o, U8(4 * n + j), U8(1), U8(2), x, xb + 32 * j, s0, s1
                ) - Q3_K_OFFSET * (s0 * xs[k] + s1 * xs[k + 1])
        acc += f16_at(row, o + Q3_K_D) * block
    return acc


@kernel()
def matvec_q3_k(raw, x, out):
    """``out = W @ x`` for a Q3_K matrix (see :func:`matvec_q4_k`)."""
    xs = np.empty(x.size // 16, dtype=F32)
    sub_sums(x, 16, xs)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        out[r] = dot_q3_k(raw[r], x, xs)


@kernel()
def matmat_q3_k(raw, xt, out):
    """``out = xt @ W.T`` for a Q3_K matrix (see :func:`matmat_q4_k`)."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_q3_k(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_q3_k(raw, out):
    """Exact dequantization of a Q3_K matrix."""
    for r in range(raw.shape[0]):
        decode_q3_k(raw[r], out[r])
