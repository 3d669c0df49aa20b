"""The tail of ``ggml_swiglu_split`` after numpy's ``exp``, bit for bit numpy's three steps."""

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
