"""One compiled call over several matrices given by address (:mod:`aioexperts._compute.grouped`)."""

from __future__ import annotations

import numba
import numpy as np

from ..jit import kernel
from .common import address_pointer


def make_group(one):  # untyped: a numba kernel factory (mypy skips this package)
    """``group(addresses, rows, row_bytes, x, x_rows, out) -> bool``: ``one(W_i, x[x_rows[i]], out[i])``
    for each ``W_i``, the ``(rows, row_bytes)`` uint8 matrix at ``addresses[i]``; True when every
    call returned True. ``one`` is a compiled one-token kernel (``fused.one_token_int8_kernel``);
    the wrapper is compiled per kernel and not cached on disk (it closes over a dispatcher)."""

    @kernel(cache=False)
    def group(addresses, rows, row_bytes, x, x_rows, out):
        ok = True
        for i in range(addresses.shape[0]):
            raw = numba.carray(address_pointer(addresses[i]), (rows, row_bytes), np.uint8)
            ok &= one(raw, x[x_rows[i]], out[i])
        return ok

    return group
