"""The int8 one-token kernels: ``x`` quantized to 8 bits per call, integer dot products per block.

This is what llama.cpp's CPU backend does (``ggml_vec_dot_<type>_q8_<K|0|1>``): ``x`` is quantized
once per call like ``quantize_row_q8_K`` (256-value blocks, float32 scale, sums of 16), or
``quantize_row_q8_0`` / ``quantize_row_q8_1`` (32-value blocks, float16 scale; Q8_1 adds
``d * sum(q)``), then each weight block is multiplied in integers (:mod:`.simd`: ``vpdpbusd`` on
AVX-512 VNNI) and scaled once. The error, about 5e-3 relative, comes from the rounding of ``x``;
llama.cpp has the same. Selected with ``fused.set_precision("int8")``.

Every kernel returns True, or False when ``x`` holds NaN or inf (those do not quantize: ``out`` is
then left unwritten, and the caller takes another path).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .codebook import IQ4_NL_BYTES, KVALUES_IQ4, KVALUES_MXFP4
from .common import F32, PREFETCH_ROWS, U32, f16_at, prefetch_row
from .legacy import Q4_1_BYTES, Q5_1_BYTES, qh_at
from .rowdot import (
    rowdot_iq4_xs,
    rowdot_mxfp4,
    rowdot_q2_k,
    rowdot_q3_k,
    rowdot_q4_k,
    rowdot_q5_k,
    rowdot_q6_k,
    rowdot_q8_0,
)
from .rowdot_legacy import rowdot_q4_0, rowdot_q5_0
from .rowdots import TOKENS, rowdots_q4_k, rowdots_q5_k
from .simd import make_lut_dots, nib32_dot_q8

# ruff: noqa: N803, N806

I8 = np.int8
I32 = np.int32
QK = 32
QK_K = 256
SUM16 = 16
Q8_MAX = F32(127.0)
#: float32 bits kept when rounding to float16: the 13 low mantissa bits go
HALF_DROPPED_BITS = U32(13)
HALF_MIN_NORMAL = F32(2.0**-14)
HALF_SUBNORMAL_UNIT = F32(2.0**-24)
#: float32 bits: all but the sign; the smallest non-finite magnitude (inf; NaN above)
ABS_BITS = U32(0x7FFF_FFFF)
INF_BITS = U32(0x7F80_0000)

_, iq4_dot_q8 = make_lut_dots(tuple(int(v) for v in KVALUES_IQ4))
_, mxfp4_dot_q8 = make_lut_dots(tuple(int(v) for v in KVALUES_MXFP4))


# ----------------------------------------------------------------------------------------------
# quantizing x


@kernel(exact=True, inline=True)
def round_to_half(value):
    """``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(value))`` for finite ``value >= 0`` below 65504.

    Round half to even to 10 mantissa bits (normals) or to multiples of 2**-24 (subnormals).
    """
    if value < HALF_MIN_NORMAL:
        return F32(np.rint(value / HALF_SUBNORMAL_UNIT)) * HALF_SUBNORMAL_UNIT
    bits = F32(value).view(U32)
    lsb = (bits >> HALF_DROPPED_BITS) & U32(1)
    rounded = U32((bits + U32(0x0FFF) + lsb) & U32(0xFFFF_E000))
    return rounded.view(F32)


@kernel(inline=True)
def abs_max_bits(bits, base, size):
    """The largest ``|x|`` of ``x[base : base + size]`` as float32 bits (``bits``: ``x`` viewed as
    uint32, sign bits cleared here): for non-negative floats the integer order is the float order,
    and an integer maximum vectorizes without fastmath. At least ``0x7F800000`` when some value is
    inf or NaN."""
    amax = U32(0)
    for j in range(size):
        amax = max(amax, U32(bits[base + j] & ABS_BITS))
    return amax


@kernel(inline=True)
def quantize_q8_k(x, q, d, bsums):
    """``quantize_row_q8_K_ref``: per 256 values, ``iscale = -127 / max`` (``max``: the value of
    largest magnitude, sign kept: the first such value), ``q = min(127, nearest_int(iscale * x))``,
    ``d = 1 / iscale``; ``bsums``: sums of ``q`` per 16 values. Returns whether every value of ``x``
    is finite (if not, ``q``, ``d``, ``bsums`` are meaningless: NaN and inf do not quantize)."""
    bits = x.view(U32)
    for b in range(x.size // QK_K):
        base = b * QK_K
        amax = abs_max_bits(bits, base, QK_K)
        if amax >= INF_BITS:
            return False
        if amax == 0:
            d[b] = 0
            for j in range(QK_K):
                q[base + j] = 0
            for j in range(QK_K // SUM16):
                bsums[b * SUM16 + j] = 0
            continue
        j = 0
        while U32(bits[base + j] & ABS_BITS) != amax:
            j += 1
        iscale = -Q8_MAX / x[base + j]
        for j in range(QK_K):
            q[base + j] = I8(min(I32(127), I32(np.rint(iscale * x[base + j]))))
        for j in range(QK_K // SUM16):
            s = I32(0)
            for i in range(SUM16):
                s += I32(q[base + j * SUM16 + i])
            bsums[b * SUM16 + j] = s
        d[b] = F32(1.0) / iscale
    return True


@kernel(inline=True)
def quantize_rows_q8_k(xt, n_rows):
    """:func:`quantize_q8_k` of every row of ``xt`` (``(n, cols)`` float32) into ``n_rows >= n`` rows
    (the rows past ``n`` zero: a tile's padding): ``(q, d, bsums, finite)``, int8 ``(n_rows, cols)``,
    float32 ``(n_rows, cols // 256)``, int32 ``(n_rows, cols // 16)``, and whether ``xt`` is finite."""
    n, cols = xt.shape
    q = np.zeros((n_rows, cols), dtype=I8)
    d = np.zeros((n_rows, cols // QK_K), dtype=F32)
    bsums = np.zeros((n_rows, cols // SUM16), dtype=I32)
    finite = True
    for t in range(n):
        finite &= quantize_q8_k(xt[t], q[t], d[t], bsums[t])
    return q, d, bsums, finite


@kernel(inline=True)
def quantize_q8_0(x, q, d, s):
    """x86 ``quantize_row_q8_0`` / ``quantize_row_q8_1`` (ggml-cpu/arch/x86/quants.c, AVX2): per 32
    values ``d = amax / 127`` (kept as float16), ``q = round_half_even(x * (127 / amax))``;
    ``s = d * sum(q)`` (float16), used by Q4_1 and Q5_1. Returns whether every value of ``x`` is
    finite (if not, ``q``, ``d``, ``s`` are meaningless)."""
    bits = x.view(U32)
    for b in range(x.size // QK):
        base = b * QK
        amax_bits = U32(abs_max_bits(bits, base, QK))
        if amax_bits >= INF_BITS:
            return False
        amax = amax_bits.view(F32)
        scale = amax / Q8_MAX
        inverse = Q8_MAX / amax if amax != 0 else F32(0.0)
        total = I32(0)
        for j in range(QK):
            qv = I32(np.rint(x[base + j] * inverse))  # _mm256_round_ps(_MM_ROUND_NEAREST)
            q[base + j] = I8(qv)
            total += I32(qv)
        d[b] = round_to_half(scale)
        s[b] = round_to_half(abs(F32(total) * scale)) * (F32(1.0) if total >= 0 else F32(-1.0))
    return True


# ----------------------------------------------------------------------------------------------
# 32-value block types against Q8_0 / Q8_1


@kernel(inline=True)
def lane_offsets(q, offset):
    """int32 ``offset * sum(q[4 k : 4 k + 4])`` for every ``k``: per 32-value block the 8 lanes of
    ggml's ``mul_sum_i8_pairs_float`` (:mod:`.rowdot_legacy`'s ``offsets``)."""
    out = np.empty(q.size // 4, dtype=I32)
    for k in range(out.size):
        out[k] = offset * (I32(q[4 * k]) + I32(q[4 * k + 1]) + I32(q[4 * k + 2]) + I32(q[4 * k + 3]))
    return out


@kernel(exact=True)
def matvec_int8_q4_0(raw, x, out):
    """``ggml_vec_dot_q4_0_q8_0``: ``d_w * d_x * sum((q4 - 8) * q8)`` per block
    (:func:`.rowdot_legacy.rowdot_q4_0`)."""
    n_blocks = x.size // QK
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    s = np.empty(n_blocks, dtype=F32)
    if not quantize_q8_0(x, q, d, s):
        return False
    offsets = lane_offsets(q, I32(8))
    for r in range(raw.shape[0]):
        out[r] = rowdot_q4_0(raw[r], q, d, offsets, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_q4_0(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_q4_0` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK
    q = np.empty((n, cols), dtype=I8)
    d = np.empty((n, n_blocks), dtype=F32)
    s = np.empty((n, n_blocks), dtype=F32)
    finite = True
    for t in range(n):
        finite &= quantize_q8_0(xt[t], q[t], d[t], s[t])
    if not finite:
        return False
    offsets = np.empty((n, cols // 4), dtype=I32)
    for t in range(n):
        offsets[t] = lane_offsets(q[t], I32(8))
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(n):
            out[t, r] = rowdot_q4_0(row, q[t], d[t], offsets[t], n_blocks)
    return True


@kernel()
def matvec_int8_q4_1(raw, x, out):
    """``ggml_vec_dot_q4_1_q8_1``: ``d_w * d_x * sum(q4 * q8) + m_w * s_x`` per block."""
    n_blocks = x.size // QK
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    s = np.empty(n_blocks, dtype=F32)
    if not quantize_q8_0(x, q, d, s):
        return False
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        row = raw[r]
        acc = F32(0.0)
        for b in range(n_blocks):
            o = b * Q4_1_BYTES
            acc += f16_at(row, o) * d[b] * F32(nib32_dot_q8(row, o + 4, U32(0), q, b * QK)) + f16_at(row, o + 2) * s[b]
        out[r] = acc
    return True


@kernel(exact=True)
def matvec_int8_q5_0(raw, x, out):
    """``ggml_vec_dot_q5_0_q8_0``: ``d_w * d_x * sum((q5 - 16) * q8)`` per block
    (:func:`.rowdot_legacy.rowdot_q5_0`)."""
    n_blocks = x.size // QK
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    s = np.empty(n_blocks, dtype=F32)
    if not quantize_q8_0(x, q, d, s):
        return False
    offsets = lane_offsets(q, I32(16))
    for r in range(raw.shape[0]):
        out[r] = rowdot_q5_0(raw[r], q, d, offsets, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_q5_0(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_q5_0` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK
    q = np.empty((n, cols), dtype=I8)
    d = np.empty((n, n_blocks), dtype=F32)
    s = np.empty((n, n_blocks), dtype=F32)
    finite = True
    for t in range(n):
        finite &= quantize_q8_0(xt[t], q[t], d[t], s[t])
    if not finite:
        return False
    offsets = np.empty((n, cols // 4), dtype=I32)
    for t in range(n):
        offsets[t] = lane_offsets(q[t], I32(16))
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(n):
            out[t, r] = rowdot_q5_0(row, q[t], d[t], offsets[t], n_blocks)
    return True


@kernel()
def matvec_int8_q5_1(raw, x, out):
    """``ggml_vec_dot_q5_1_q8_1``: ``d_w * d_x * sum(q5 * q8) + m_w * s_x`` per block."""
    n_blocks = x.size // QK
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    s = np.empty(n_blocks, dtype=F32)
    if not quantize_q8_0(x, q, d, s):
        return False
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        row = raw[r]
        acc = F32(0.0)
        for b in range(n_blocks):
            o = b * Q5_1_BYTES
            dot = nib32_dot_q8(row, o + 8, qh_at(row, o + 4), q, b * QK)
            acc += f16_at(row, o) * d[b] * F32(dot) + f16_at(row, o + 2) * s[b]
        out[r] = acc
    return True


@kernel(exact=True)
def matvec_int8_q8_0(raw, x, out):
    """``ggml_vec_dot_q8_0_q8_0``: ``d_w * d_x * sum(q_w * q_x)`` per block (:func:`.rowdot.rowdot_q8_0`)."""
    n_blocks = x.size // QK
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    s = np.empty(n_blocks, dtype=F32)
    if not quantize_q8_0(x, q, d, s):
        return False
    for r in range(raw.shape[0]):
        out[r] = rowdot_q8_0(raw[r], q, d, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_q8_0(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_q8_0` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK
    q = np.empty((n, cols), dtype=I8)
    d = np.empty((n, n_blocks), dtype=F32)
    s = np.empty((n, n_blocks), dtype=F32)
    finite = True
    for t in range(n):
        finite &= quantize_q8_0(xt[t], q[t], d[t], s[t])
    if not finite:
        return False
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(n):
            out[t, r] = rowdot_q8_0(row, q[t], d[t], n_blocks)
    return True


@kernel(inline=True)
def block_sums(q, sums):
    """``sums[b] = 128 * sum(q[32 b : 32 b + 32])``: the bias of the unsigned codebook products."""
    for b in range(sums.size):
        t = I32(0)
        for j in range(QK):
            t += I32(q[b * QK + j])
        sums[b] = t * I32(128)


@kernel()
def matvec_int8_iq4_nl(raw, x, out):
    """``ggml_vec_dot_iq4_nl_q8_0``: ``d_w * d_x * sum(kvalues[q] * q8)`` per block."""
    n_blocks = x.size // QK
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    s = np.empty(n_blocks, dtype=F32)
    if not quantize_q8_0(x, q, d, s):
        return False
    bias = np.empty(n_blocks, dtype=I32)
    block_sums(q, bias)
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        row = raw[r]
        acc = F32(0.0)
        for b in range(n_blocks):
            o = b * IQ4_NL_BYTES
            acc += f16_at(row, o) * d[b] * F32(iq4_dot_q8(row, o + 2, q, b * QK) - bias[b])
        out[r] = acc
    return True


@kernel(exact=True)
def matvec_int8_mxfp4(raw, x, out):
    """``ggml_vec_dot_mxfp4_q8_0``: ``e8m0_half(e) * d_x * sum(kvalues[q] * q8)`` per block
    (:func:`.rowdot.rowdot_mxfp4`)."""
    n_blocks = x.size // QK
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    s = np.empty(n_blocks, dtype=F32)
    if not quantize_q8_0(x, q, d, s):
        return False
    for r in range(raw.shape[0]):
        out[r] = rowdot_mxfp4(raw[r], q, d, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_mxfp4(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_mxfp4` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK
    q = np.empty((n, cols), dtype=I8)
    d = np.empty((n, n_blocks), dtype=F32)
    s = np.empty((n, n_blocks), dtype=F32)
    finite = True
    for t in range(n):
        finite &= quantize_q8_0(xt[t], q[t], d[t], s[t])
    if not finite:
        return False
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(n):
            out[t, r] = rowdot_mxfp4(row, q[t], d[t], n_blocks)
    return True


# ----------------------------------------------------------------------------------------------
# k-quants against Q8_K


@kernel(inline=True)
def bsum_pairs(bsums):
    """``(n, 8 n_blocks)`` int16 ``bsums[:, 2j] + bsums[:, 2j+1]`` (:mod:`.rowdots`' argument)."""
    n, m = bsums.shape
    pairs = np.empty((n, m // 2), dtype=np.int16)
    for t in range(n):
        for j in range(m // 2):
            pairs[t, j] = np.int16(bsums[t, 2 * j] + bsums[t, 2 * j + 1])
    return pairs


@kernel(exact=True)
def matvec_int8_q4_k(raw, x, out):
    """``ggml_vec_dot_q4_K_q8_K``: ``d_w d_x sum_j sc_j dot_j - dmin_w d_x sum_j m_j bsum_j``
    (:func:`.rowdot.rowdot_q4_k`)."""
    n_blocks = x.size // QK_K
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    bsums = np.empty(n_blocks * SUM16, dtype=I32)
    if not quantize_q8_k(x, q, d, bsums):
        return False
    for r in range(raw.shape[0]):
        out[r] = rowdot_q4_k(raw[r], q, d, bsums, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_q4_k(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_q4_k` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK_K
    q, d, bsums, finite = quantize_rows_q8_k(xt, n)
    if not finite:
        return False
    full = n - n % TOKENS  # TOKENS tokens at a time share each block's decoding (.rowdots), then one by one
    pairs = bsum_pairs(bsums)
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(0, full, TOKENS):
            y0, y1, y2, y3 = rowdots_q4_k(row, q, d, pairs, n_blocks, t)
            out[t, r] = y0
            out[t + 1, r] = y1
            out[t + 2, r] = y2
            out[t + 3, r] = y3
        for t in range(full, n):
            out[t, r] = rowdot_q4_k(row, q[t], d[t], bsums[t], n_blocks)
    return True


@kernel(exact=True)
def matvec_int8_q5_k(raw, x, out):
    """``ggml_vec_dot_q5_K_q8_K``: as Q4_K with the fifth bit of each code from ``qh``
    (:func:`.rowdot.rowdot_q5_k`)."""
    n_blocks = x.size // QK_K
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    bsums = np.empty(n_blocks * SUM16, dtype=I32)
    if not quantize_q8_k(x, q, d, bsums):
        return False
    for r in range(raw.shape[0]):
        out[r] = rowdot_q5_k(raw[r], q, d, bsums, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_q5_k(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_q5_k` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK_K
    q, d, bsums, finite = quantize_rows_q8_k(xt, n)
    if not finite:
        return False
    full = n - n % TOKENS  # TOKENS tokens at a time share each block's decoding (.rowdots), then one by one
    pairs = bsum_pairs(bsums)
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(0, full, TOKENS):
            y0, y1, y2, y3 = rowdots_q5_k(row, q, d, pairs, n_blocks, t)
            out[t, r] = y0
            out[t + 1, r] = y1
            out[t + 2, r] = y2
            out[t + 3, r] = y3
        for t in range(full, n):
            out[t, r] = rowdot_q5_k(row, q[t], d[t], bsums[t], n_blocks)
    return True


@kernel(exact=True)
def matvec_int8_q6_k(raw, x, out):
    """``ggml_vec_dot_q6_K_q8_K``: ``d_w d_x sum_j sc_j (dot_j - 32 bsum_j)`` over 16-value sub-blocks
    (:func:`.rowdot.rowdot_q6_k`)."""
    n_blocks = x.size // QK_K
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    bsums = np.empty(n_blocks * SUM16, dtype=I32)
    if not quantize_q8_k(x, q, d, bsums):
        return False
    for r in range(raw.shape[0]):
        out[r] = rowdot_q6_k(raw[r], q, d, bsums, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_q6_k(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_q6_k` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK_K
    q, d, bsums, finite = quantize_rows_q8_k(xt, n)
    if not finite:
        return False
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(n):
            out[t, r] = rowdot_q6_k(row, q[t], d[t], bsums[t], n_blocks)
    return True


@kernel(exact=True)
def matvec_int8_q2_k(raw, x, out):
    """``ggml_vec_dot_q2_K_q8_K``: ``d_w d_x sum_j (sc_j & 15) dot_j - dmin_w d_x sum_j (sc_j >> 4) bsum_j``
    (:func:`.rowdot.rowdot_q2_k`)."""
    n_blocks = x.size // QK_K
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    bsums = np.empty(n_blocks * SUM16, dtype=I32)
    if not quantize_q8_k(x, q, d, bsums):
        return False
    for r in range(raw.shape[0]):
        out[r] = rowdot_q2_k(raw[r], q, d, bsums, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_q2_k(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_q2_k` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK_K
    q, d, bsums, finite = quantize_rows_q8_k(xt, n)
    if not finite:
        return False
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(n):
            out[t, r] = rowdot_q2_k(row, q[t], d[t], bsums[t], n_blocks)
    return True


@kernel(exact=True)
def matvec_int8_q3_k(raw, x, out):
    """``ggml_vec_dot_q3_K_q8_K``: ``d_w d_x sum_j (sc_j - 32) dot(low | 4 hbit - 4, q8_j)``
    (:func:`.rowdot.rowdot_q3_k`)."""
    n_blocks = x.size // QK_K
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    bsums = np.empty(n_blocks * SUM16, dtype=I32)
    if not quantize_q8_k(x, q, d, bsums):
        return False
    for r in range(raw.shape[0]):
        out[r] = rowdot_q3_k(raw[r], q, d, bsums, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_q3_k(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_q3_k` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK_K
    q, d, bsums, finite = quantize_rows_q8_k(xt, n)
    if not finite:
        return False
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(n):
            out[t, r] = rowdot_q3_k(row, q[t], d[t], bsums[t], n_blocks)
    return True


@kernel(exact=True)
def matvec_int8_iq4_xs(raw, x, out):
    """``ggml_vec_dot_iq4_xs_q8_K``: ``d_w d_x sum_j (sc_j - 32) sum(kvalues[q] * q8)``
    (:func:`.rowdot.rowdot_iq4_xs`)."""
    n_blocks = x.size // QK_K
    q = np.empty(x.size, dtype=I8)
    d = np.empty(n_blocks, dtype=F32)
    bsums = np.empty(n_blocks * SUM16, dtype=I32)
    if not quantize_q8_k(x, q, d, bsums):
        return False
    for r in range(raw.shape[0]):
        out[r] = rowdot_iq4_xs(raw[r], q, d, bsums, n_blocks)
    return True


@kernel(exact=True)
def matmat_int8_iq4_xs(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token, as :func:`matvec_int8_iq4_xs` per token, bit for bit;
    each weight row is read once for all tokens (``xt``: ``(n, cols)``, ``out``: ``(n, rows)``)."""
    n, cols = xt.shape
    n_blocks = cols // QK_K
    q, d, bsums, finite = quantize_rows_q8_k(xt, n)
    if not finite:
        return False
    for r in range(raw.shape[0]):
        row = raw[r]
        for t in range(n):
            out[t, r] = rowdot_iq4_xs(row, q[t], d[t], bsums[t], n_blocks)
    return True
