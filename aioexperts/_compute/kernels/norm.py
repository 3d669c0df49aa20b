"""RMSNorm rows, bit for bit :func:`aioexperts._compute.norms.rms_norm`'s numpy arithmetic.

The mean of squares is summed in float64 the way numpy's ``add.reduce`` sums a contiguous row
(``numpy/_core/src/umath/loops_utils.h.src`` ``pairwise_sum``: fewer than 8 values in order, up to
128 in 8 interleaved sums combined pairwise, longer rows halved at a multiple of 8), each square
rounded to float32 first, as ggml's ``ggml_float`` sum of ``x * x`` (``ops.cpp``
``ggml_compute_forward_rms_norm_f32``).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel

# ruff: noqa: N803, N806

F32 = np.float32
F64 = np.float64
#: numpy's PW_BLOCKSIZE
PAIRWISE_BLOCK = 128


@kernel(exact=True, inline=True)
def _square(x, i):
    return F64(F32(x[i] * x[i]))


@kernel(exact=True)
def pairwise_squares(x, lo, n):
    """numpy's pairwise float64 sum of ``float64(x[i] * x[i])`` (float32 products) for ``i`` in ``lo..lo+n-1``."""
    if n < 8:
        res = F64(-0.0)
        for i in range(n):
            res += _square(x, lo + i)
        return res
    if n <= PAIRWISE_BLOCK:
        r0, r1, r2, r3 = _square(x, lo), _square(x, lo + 1), _square(x, lo + 2), _square(x, lo + 3)
        r4, r5, r6, r7 = _square(x, lo + 4), _square(x, lo + 5), _square(x, lo + 6), _square(x, lo + 7)
        i = 8
        m = n - n % 8
        while i < m:
            r0 += _square(x, lo + i)
            r1 += _square(x, lo + i + 1)
            r2 += _square(x, lo + i + 2)
            r3 += _square(x, lo + i + 3)
            r4 += _square(x, lo + i + 4)
            r5 += _square(x, lo + i + 5)
            r6 += _square(x, lo + i + 6)
            r7 += _square(x, lo + i + 7)
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += _square(x, lo + i)
            i += 1
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return pairwise_squares(x, lo, n2) + pairwise_squares(x, lo + n2, n - n2)


@kernel(exact=True)
def rms_norm_rows(x, weight, eps, out):
    """``out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) [* weight]`` for each row of ``x``
    ``(rows, n)`` float32 C-contiguous; ``weight`` ``(n,)`` float32 or empty (none); ``eps``
    float32; ``out`` like ``x``."""
    rows, n = x.shape
    flat = x.reshape(-1)
    for r in range(rows):
        total = F64(0.0) + pairwise_squares(flat, r * n, n)
        mean = F32(total / F64(n))
        scale = F32(F32(1.0) / np.sqrt(F32(mean + eps)))
        if weight.shape[0] == n:
            for i in range(n):
                out[r, i] = F32(x[r, i] * scale) * weight[i]
        else:
            for i in range(n):
                out[r, i] = x[r, i] * scale


@kernel(exact=True)
def all_finite(x):
    """Whether every value of the C-contiguous array ``x`` (any shape, float32) is finite."""
    flat = x.reshape(-1)
    for i in range(flat.shape[0]):
        if not np.isfinite(flat[i]):
            return False
    return True


@kernel(exact=True)
def add_rms_norm_rows(a, b, scale, weight, eps, total, out):
    """``total = a + b`` (``b * scale`` first, float32, when ``scale`` is not 0) and ``out`` its
    :func:`rms_norm_rows`, for ``(rows, n)`` float32 C-contiguous ``a``, ``b``, ``total`` and ``out``;
    ``weight`` as there. The bits of numpy's ``a + b * scale`` and then of the norm. Returns whether
    ``total`` is finite; when not, ``out`` is left unwritten."""
    rows, n = a.shape
    finite = True
    for r in range(rows):
        for i in range(n):
            v = b[r, i]
            if scale != F32(0.0):
                v = F32(v * scale)
            s = F32(a[r, i] + v)
            total[r, i] = s
            if not np.isfinite(s):
                finite = False
    if finite:
        rms_norm_rows(total, weight, eps, out)
    return finite
