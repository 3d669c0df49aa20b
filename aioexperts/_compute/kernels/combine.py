"""The weighted sum of a decode row's expert outputs, bit for bit numpy's slot-order sum; the
lookup of the row's experts in a layer's address table."""

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


@kernel()
def gather_addresses(table, ids, gate_up, down):
    """A decode row's expert addresses from a layer's table (``ExpertTable.addresses``):
    ``gate_up[i] = table[0, ids[i]]``, ``gate_up[n + i] = table[1, ids[i]]``, ``down[i] =
    table[2, ids[i]]`` for the ``n`` ids. ``table`` ``(3, m)``, ``ids`` ``(n,)``, ``gate_up``
    ``(2n,)``, ``down`` ``(n,)``, all int64. False, with nothing written, when an id is outside
    ``0..m-1``."""
    n = ids.shape[0]
    m = table.shape[1]
    for i in range(n):
        e = ids[i]
        if e < 0 or e >= m:
            return False
    for i in range(n):
        e = ids[i]
        gate_up[i] = table[0, e]
        gate_up[n + i] = table[1, e]
        down[i] = table[2, e]
    return True
