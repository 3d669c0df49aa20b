"""The weighted sum of a decode row's expert outputs, bit for bit numpy's slot-order sum."""

from __future__ import annotations

from ..jit import kernel

# ruff: noqa: N803


@kernel(exact=True)
def weighted_rows_sum(ys, w, out):
    """``out = ys[0] * w[0] + ys[1] * w[1] + ...`` in row order, each product and each sum rounded
    to float32 as numpy's ``weighted = ys * w[:, None]`` then ``out += weighted[i]`` (llama.cpp's
    ``ffn_moe_weighted`` then ``ggml_add`` of slot 0, 1, ..., k-1). ``ys`` ``(n, d)``, ``w``
    ``(n,)``, ``out`` ``(d,)`` float32; ``n >= 1``."""
    n, d = ys.shape
    w0 = w[0]
    for j in range(d):
        out[j] = ys[0, j] * w0
    for i in range(1, n):
        wi = w[i]
        for j in range(d):
            out[j] += ys[i, j] * wi
