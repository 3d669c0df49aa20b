"""Several one-token products of one ggml type in one compiled call: a decode step's experts.

A decode step computes each routed expert's gate, up and down products for one token: 24 products
per layer at top-8. Through :func:`aioexperts._compute.fused.linear` each pays about 10 us of
argument handling and dispatch in Python, and an expert's products and its activation are one
compute-pool item each. :func:`matvec_group` runs a list of products of one type and shape in one
compiled call of the kernel :func:`~aioexperts._compute.fused.linear` itself runs for one token
(:func:`~aioexperts._compute.fused.one_token_int8_kernel`), so each output has the bits it gets
alone. The matrices are given by their memory (``memoryview`` of slot memory); their sizes are
checked here, and the caller keeps them alive (pinned) for the call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
from gguf import GGMLQuantizationType

from aioexperts._compute import fused as _fused
from aioexperts._errors import ConfigError, FormatError

__all__ = ("group_kernel", "matvec_group")

log = logging.getLogger("aioexperts")
_lock = threading.Lock()
_UNSEEN: Any = object()
_groups: dict[Any, Callable[..., bool] | None] = {}


def group_kernel(ggml_type: GGMLQuantizationType) -> tuple[Callable[..., bool], Callable[[int], int]] | None:
    """The compiled group call of ``ggml_type`` and its bytes per row for a number of columns, or
    None where :func:`~aioexperts._compute.fused.one_token_int8_kernel` has no kernel (float
    precision, numpy backend, a type without an int8 kernel). Compiled on first use (about 0.3 s;
    not cached on disk: it wraps a dispatcher)."""
    served = _fused.one_token_int8_kernel(ggml_type)
    if served is None:
        return None
    one, row_bytes = served
    group = _groups.get(one, _UNSEEN)
    if group is _UNSEEN:
        with _lock:
            group = _groups.get(one, _UNSEEN)
            if group is _UNSEEN:
                try:
                    group = _compile_group(one)
                except Exception as exc:  # a broken numba/llvmlite can raise anything: the per-product path serves
                    log.warning("the grouped decode products are off (%s: %s)", type(exc).__name__, exc)
                    group = None
                _groups[one] = group
    if group is None:
        return None
    return group, row_bytes


def _compile_group(one: Callable[..., bool]) -> Callable[..., bool]:
    from .kernels.group import make_group

    group = cast("Callable[..., bool]", make_group(one))  # type: ignore[no-untyped-call]
    # numba compiles at the first call: do it here (warm-up), not in a decode step's first token
    # (0.3 s each), for x writable (activations) and read-only (a plan's row)
    none = np.empty(0, dtype=np.int64)
    out = np.empty((0, 1), dtype=np.float32)
    for writable in (True, False):
        x = np.zeros((1, 1), dtype=np.float32)
        x.flags.writeable = writable
        group(none, 0, 0, x, none, out)
    return group


def matvec_group(
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, int],
    matrices: Sequence[memoryview],
    x: np.ndarray,
    x_rows: np.ndarray,
    out: np.ndarray,
) -> bool:
    """``out[i] = W_i @ x[x_rows[i]]`` for matrices ``W_i`` of one type and ``shape``, in one call
    (module docstring); the same bits as :func:`~aioexperts._compute.fused.linear` of each alone.

    Args:
        ggml_type: the type of every matrix.
        shape: ``(rows, cols)`` of every matrix, numpy order.
        matrices: each matrix's raw ggml bytes (read-only ``memoryview``, e.g. of a pinned slot),
            exactly ``rows * row_bytes`` long; kept alive by the caller during the call.
        x: ``(m, cols)`` float32, C-contiguous.
        x_rows: ``(len(matrices),)`` int64, the row of ``x`` each matrix takes, in ``0..m-1``.
        out: ``(len(matrices), rows)`` float32, C-contiguous.

    Returns:
        False, with nothing written that may be used, when no group kernel serves the type (see
        :func:`group_kernel`) or a row of ``x`` is not finite: the caller takes ``linear``.

    Raises:
        FormatError: a matrix's byte count does not fit ``shape`` and the type.
        ConfigError: ``x``, ``x_rows`` or ``out`` of the wrong dtype, shape or layout.
    """
    served = group_kernel(ggml_type)
    if served is None:
        return False
    group, row_bytes_of = served
    rows, cols = shape
    n = len(matrices)
    if (
        x.dtype != np.float32
        or x.ndim != 2
        or x.shape[1] != cols
        or not x.flags.c_contiguous
        or out.dtype != np.float32
        or out.shape != (n, rows)
        or not out.flags.c_contiguous
        or x_rows.dtype != np.int64
        or x_rows.shape != (n,)
        or (n and not 0 <= int(x_rows.min()) <= int(x_rows.max()) < x.shape[0])
    ):
        raise ConfigError(
            f"matvec_group: x {x.dtype}{x.shape}, x_rows {x_rows.dtype}{x_rows.shape}, out {out.dtype}{out.shape} "
            f"do not fit {n} matrices of shape {shape}"
        )
    row_bytes = row_bytes_of(cols)
    addresses = np.empty(n, dtype=np.int64)
    for i, data in enumerate(matrices):
        if data.nbytes != rows * row_bytes:
            raise FormatError(
                f"{ggml_type.name} matrix of shape {shape} needs {rows * row_bytes} bytes, got {data.nbytes}"
            )
        addresses[i] = np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0]
    return bool(group(addresses, rows, row_bytes, x, x_rows, out))
