"""RoPE rotation of every head, bit for bit :func:`aioexperts._compute.rope.apply_rope`'s numpy
arithmetic (ggml ``ops.cpp`` ``rotate_pairs``: ``x0 c - x1 s``, ``x0 s + x1 c`` in float32, each
product and sum rounded on its own)."""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .norm import rms_norm_rows

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


@kernel(exact=True)
def norm_rope_heads(x, norm, weight, eps, cos, sin, neox, n_rot, tmp, out):
    """``out`` = RoPE (:func:`rope_heads`) of ``x`` ``(T, H, D)`` float32, each head first RMS-normed
    (:func:`aioexperts._compute.kernels.norm.rms_norm_rows` with ``weight`` ``(D,)`` or empty) when
    ``norm``: a decode step's per-head q/k norm and rotation in one call, bit for bit the two.
    ``tmp`` like ``x`` (the normed heads); every array C-contiguous."""
    T, H, D = x.shape
    if norm:
        rms_norm_rows(x.reshape(T * H, D), weight, eps, tmp.reshape(T * H, D))
        rope_heads(tmp, cos, sin, neox, n_rot, out)
    else:
        rope_heads(x, cos, sin, neox, n_rot, out)
