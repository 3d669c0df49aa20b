"""The fan-out task of one-token products over matrices given by address (:mod:`aioexperts._compute.grouped`).

The descriptor's layout imports without numba (:mod:`aioexperts._compute.grouped` reads it at
import); :func:`make_group_task` imports numba.
"""

from __future__ import annotations

import numpy as np

#: the descriptor of a :func:`make_group_task` task: ``int64[GROUP_DESC_SIZE]`` of
#: (addresses of: weight addresses, row counts, x, x rows, output offsets), row bytes, columns, the
#: output base address (item ``i`` writes at ``base + offsets[i]``)
G_ADDRESSES, G_ROWS, G_X, G_X_ROWS, G_OUTS, G_ROW_BYTES, G_COLS, G_OUT_BASE = range(8)
GROUP_DESC_SIZE = 8


def make_group_task(one):  # untyped: a numba kernel factory (mypy skips this package)
    """A fan-out task (:mod:`.fanout`) of one product per item: item ``i`` is ``one(W_i, x[x_rows[i]],
    out_i)`` with ``W_i`` the ``(rows[i], row_bytes)`` uint8 matrix at ``addresses[i]`` and ``out_i``
    the ``(rows[i],)`` float32 at ``base + offsets[i]``; returns 0, or 1 when ``one`` returned False (x not
    finite). Every address comes from the descriptor (see :data:`G_ADDRESSES`); the caller checked
    the sizes and keeps the memory alive. Compiled per kernel, not cached on disk."""
    import numba

    from .common import address_pointer

    sig = numba.types.int64(numba.types.int64, numba.types.int64)

    @numba.cfunc(sig, nopython=True, error_model="numpy", boundscheck=False)
    def task(desc_address, item):
        desc = numba.carray(address_pointer(desc_address), (GROUP_DESC_SIZE,), np.int64)
        n = item + 1
        rows = numba.carray(address_pointer(desc[G_ROWS]), (n,), np.int64)[item]
        address = numba.carray(address_pointer(desc[G_ADDRESSES]), (n,), np.int64)[item]
        x_row = numba.carray(address_pointer(desc[G_X_ROWS]), (n,), np.int64)[item]
        out = desc[G_OUT_BASE] + numba.carray(address_pointer(desc[G_OUTS]), (n,), np.int64)[item]
        cols = desc[G_COLS]
        raw = numba.carray(address_pointer(address), (rows, desc[G_ROW_BYTES]), np.uint8)
        x = numba.carray(address_pointer(desc[G_X] + x_row * cols * 4), (cols,), np.float32)
        y = numba.carray(address_pointer(out), (rows,), np.float32)
        return 0 if one(raw, x, y) else 1

    return task
