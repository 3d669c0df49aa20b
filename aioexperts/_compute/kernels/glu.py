"""``ggml_swiglu_split`` around numpy's ``exp``: its negation before and its tail after, bit for bit
numpy's steps."""

from __future__ import annotations

import numpy as np

from ..jit import kernel


@kernel(exact=True)
def silu_mul_tail(g, e, u, out):
    """``out = g / (e + 1) * u`` elementwise, each step rounded to float32 as numpy's ``e += 1``,
    ``np.divide(g, e, out=g)``, ``np.multiply(g, u, out=out)`` (``e = exp(-g)``: SiLU(g) * u).
    ``g``, ``e``, ``u``, ``out`` ``(n, m)`` float32 of one shape; ``g`` and ``e`` are clobbered as
    numpy's steps clobber them."""
    n, m = g.shape
    one = np.float32(1.0)
    for i in range(n):
        for j in range(m):
            d = e[i, j] + one
            e[i, j] = d
            q = g[i, j] / d
            g[i, j] = q
            out[i, j] = q * u[i, j]


#: ``exp`` of float32 values above this may overflow to inf (ln(FLT_MAX) is 88.72...)
EXP_OVERFLOW_FROM = np.float32(88.0)


@kernel(exact=True)
def negate_rows(g, out):
    """``out = -g`` elementwise by flipping the sign bit (``np.negative``'s bits, NaNs included);
    returns whether any ``-g`` exceeds :data:`EXP_OVERFLOW_FROM` (numpy's ``exp`` of it may warn of
    an overflow). ``g``, ``out`` ``(n, m)`` float32 of one shape."""
    n, m = g.shape
    gi = g.view(np.uint32)
    oi = out.view(np.uint32)
    sign = np.uint32(0x80000000)
    limit = EXP_OVERFLOW_FROM
    may_overflow = False
    for i in range(n):
        for j in range(m):
            oi[i, j] = gi[i, j] ^ sign
            if out[i, j] > limit:
                may_overflow = True
    return may_overflow
