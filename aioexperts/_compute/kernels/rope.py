"""RoPE rotation of every head, bit for bit :func:`aioexperts._compute.rope.apply_rope`'s numpy
arithmetic (ggml ``ops.cpp`` ``rotate_pairs``: ``x0 c - x1 s``, ``x0 s + x1 c`` in float32, each
product and sum rounded on its own)."""

from __future__ import annotations

import numpy as np

from ..jit import kernel

# ruff: noqa: N803, N806

F32 = np.float32


@kernel(exact=True)
def rope_heads(x, cos, sin, neox, n_rot, out):
    """``out`` = ``x`` ``(T, H, D)`` float32 with the first ``n_rot`` dims of every head rotated by
    ``cos``/``sin`` ``(T, n_rot/2)`` float32: pairs ``(i, i + n_rot/2)`` when ``neox``, else
    ``(2i, 2i+1)``; ``out`` like ``x`` (C-contiguous)."""
    T, H, D = x.shape
    half = n_rot // 2
    for t in range(T):
        for h in range(H):
            for d in range(n_rot, D):
                out[t, h, d] = x[t, h, d]
            for i in range(half):
                c = cos[t, i]
                s = sin[t, i]
                if neox:
                    a = x[t, h, i]
                    b = x[t, h, i + half]
                    out[t, h, i] = F32(a * c) - F32(b * s)
                    out[t, h, i + half] = F32(a * s) + F32(b * c)
                else:
                    a = x[t, h, 2 * i]
                    b = x[t, h, 2 * i + 1]
                    out[t, h, 2 * i] = F32(a * c) - F32(b * s)
                    out[t, h, 2 * i + 1] = F32(a * s) + F32(b * c)
