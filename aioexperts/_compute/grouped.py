"""Several one-token products of one ggml type in one fan-out: a decode step's experts and dense products.

A decode step computes each routed expert's gate, up and down products for one token: 24 products
per layer at top-8. Through :func:`aioexperts._compute.fused.linear` each pays about 10 us of
argument handling and dispatch in Python, and spreading them over the cores through
:meth:`~aioexperts._compute.pool.ComputePool.map` makes the helper thread wait for the GIL.
:func:`matvec_group` runs a list of products of one type and shape as one compiled fan-out
(:meth:`~aioexperts._compute.pool.ComputePool.fan_out`, each product an item that the calling
thread or an idle worker claims without the GIL), with the kernel
:func:`~aioexperts._compute.fused.linear` itself runs for one token
(:func:`~aioexperts._compute.fused.one_token_int8_kernel`), so each output has the bits it gets
alone; :func:`matvec_split` does the same for row ranges of a few large matrices (attention). The
matrices are given by their memory; their sizes are checked here, and the caller keeps them alive
(pinned) for the call.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from aioexperts._compute import fused as _fused
from aioexperts._compute import pool as _pool_module
from aioexperts._errors import ConfigError, FormatError
from aioexperts._format.architectures import RopeType
from aioexperts._format.views import ProjectionView

from .kernels.group import G_ADDRESSES, G_COLS, G_OUT_BASE, G_OUTS, G_ROW_BYTES, G_ROWS, G_X, G_X_ROWS, GROUP_DESC_SIZE

__all__ = (
    "ProductTask",
    "SplitPlan",
    "f32_split_plan",
    "f32_task",
    "matvec_group",
    "matvec_split",
    "product_task",
    "split_plan",
    "warm_decode_kernels",
)

log = logging.getLogger("aioexperts")
_lock = threading.Lock()
_UNSEEN: Any = object()
_tasks: dict[Any, Any] = {}


@dataclass(frozen=True, slots=True)
class ProductTask:
    """The fan-out task of a type's one-token product (:func:`aioexperts._compute.kernels.group.make_group_task`).

    Attributes:
        address: the compiled C function's address.
        row_bytes: the type's bytes per row for a number of columns.
        cfunc: the ``numba.cfunc`` object (keeps the machine code alive).
    """

    address: int
    row_bytes: Callable[[int], int]
    cfunc: Any


def product_task(ggml_type: GGMLQuantizationType) -> ProductTask | None:
    """The fan-out task of ``ggml_type``'s one-token product, or None where
    :func:`~aioexperts._compute.fused.one_token_int8_kernel` has no kernel (float precision, numpy
    backend, a type without an int8 kernel). Compiled on first use (about 0.8 s; not cached on
    disk: it calls a dispatcher); the decode warm-up makes it."""
    served = _fused.one_token_int8_kernel(ggml_type)
    if served is None:
        return None
    one, row_bytes = served
    return _group_task(one, row_bytes, "the grouped decode products are off")


def f32_task() -> ProductTask | None:
    """The fan-out task of the one-token F32 product
    (:func:`aioexperts._compute.kernels.floats.matvec_f32_row`: ggml's ``ggml_vec_dot_f32`` sums of
    the AVX2 build), or None where numba does not serve. Compiled on first use (not cached on
    disk); the decode warm-up makes it."""
    one = _fused.compiled_kernel("floats", "matvec_f32_row")
    if one is None:
        return None
    return _group_task(one, _f32_row_bytes, "the F32 decode product's fan-out is off")


def _f32_row_bytes(cols: int) -> int:
    return 4 * cols


def _group_task(one: Callable[..., bool], row_bytes: Callable[[int], int], off: str) -> ProductTask | None:
    """The group task of the one-token kernel ``one`` (:func:`~aioexperts._compute.kernels.group.make_group_task`),
    made once per kernel; None (logged once, ``off`` saying what) where numba/llvmlite fail to make it."""
    task = _tasks.get(one, _UNSEEN)
    if task is _UNSEEN:
        with _lock:
            task = _tasks.get(one, _UNSEEN)
            if task is _UNSEEN:
                try:
                    from .kernels.group import make_group_task

                    cfunc = make_group_task(one)  # type: ignore[no-untyped-call]
                    task = ProductTask(int(cfunc.address), row_bytes, cfunc)
                except Exception as exc:  # a broken numba/llvmlite can raise anything: the caller's other path serves
                    log.warning("%s (%s: %s)", off, type(exc).__name__, exc)
                    task = None
                _tasks[one] = task
    return task  # type: ignore[no-any-return]


def f32_split_plan(matrix: np.ndarray, parts: int) -> SplitPlan | None:
    """The :class:`SplitPlan` of a C-contiguous ``(rows, cols)`` float32 ``matrix`` in ``parts``
    ranges of rows (fewer for fewer rows; a small matrix such as a router is split too), through
    :func:`f32_task`; None where no task serves. The plan holds ``matrix``'s address: the caller keeps
    it alive while it uses the plan.

    Raises:
        ConfigError: ``matrix`` is not a C-contiguous 2-D float32 array, or ``parts < 1``.
    """
    if not isinstance(matrix, np.ndarray) or matrix.dtype != np.dtype(np.float32) or matrix.ndim != 2:
        got = f"{matrix.dtype} {matrix.shape}" if isinstance(matrix, np.ndarray) else type(matrix).__name__
        raise ConfigError(f"an F32 split plan needs a 2-D native float32 matrix, got {got}")
    if not matrix.flags.c_contiguous:
        raise ConfigError("an F32 split plan needs a C-contiguous matrix (rows one after another)")
    if isinstance(parts, bool) or not isinstance(parts, int | np.integer) or parts < 1:
        raise ConfigError(f"parts must be an int >= 1, got {parts!r}")
    parts = int(parts)
    task = f32_task()
    if task is None:
        return None
    rows, cols = matrix.shape
    return _row_ranges(task, matrix.ctypes.data, rows, cols, max(1, min(parts, rows)))


def _descriptor(
    addresses: np.ndarray,
    rows: np.ndarray,
    row_bytes: int,
    x: np.ndarray,
    x_rows: np.ndarray,
    out_offsets: np.ndarray,
    out_base: int,
) -> np.ndarray:
    """The group task's descriptor (:data:`~aioexperts._compute.kernels.group.G_ADDRESSES` ...) of
    these arrays, which the caller keeps alive while it is used."""
    desc = np.zeros(GROUP_DESC_SIZE, dtype=np.int64)
    desc[G_ADDRESSES] = addresses.ctypes.data
    desc[G_ROWS] = rows.ctypes.data
    desc[G_X] = x.ctypes.data
    desc[G_X_ROWS] = x_rows.ctypes.data
    desc[G_OUTS] = out_offsets.ctypes.data
    desc[G_ROW_BYTES] = row_bytes
    desc[G_COLS] = x.shape[1]
    desc[G_OUT_BASE] = out_base
    return desc


def _fan_out(task: int, desc: np.ndarray, desc_address: int, n: int) -> bool:
    """The task's ``n`` items on the process pool (:meth:`~aioexperts._compute.pool.ComputePool.fan_out`),
    or on this thread where there is none; True when every item returned 0."""
    pool = _pool_module._current_pool()
    status = None if pool is None else pool.fan_out(task, desc, n, desc_address)
    if status is None:
        status = _fanout_module().run_inline(task, desc_address, n)
    return status == 0


@functools.cache
def _fanout_module() -> Any:
    from .kernels import fanout

    return fanout


class GroupCall:
    """A fan-out of one product task over fixed matrices, rows, inputs and outputs, prepared once:
    a call costs two stores into the descriptor and the fan-out (no array made, no address looked
    up). One thread at a time: the caller owns it (the descriptor changes per call).

    Args:
        task: the type's task (:func:`product_task`).
        addresses: ``(n,)`` int64 weight addresses, filled by the caller before each call (the
            array is the one the descriptor points to).
        rows: ``(n,)`` int64 rows of each matrix.
        row_bytes: bytes per weight row.
        x: ``(m, cols)`` float32 C-contiguous, the inputs (the caller writes them before a call).
        x_rows: ``(n,)`` int64, the row of ``x`` each item takes.
        out: ``(size,)`` float32 C-contiguous, the outputs.
        out_offsets: ``(n,)`` int64 byte offsets of each item's output in ``out``.

    The arrays are kept here; the caller checked their sizes (:func:`matvec_group` does).
    """

    __slots__ = ("_desc", "_desc_address", "_keep", "addresses", "n", "task")

    def __init__(
        self,
        task: ProductTask,
        addresses: np.ndarray,
        rows: np.ndarray,
        row_bytes: int,
        x: np.ndarray,
        x_rows: np.ndarray,
        out: np.ndarray,
        out_offsets: np.ndarray,
    ) -> None:
        self.task = task
        self.n = len(addresses)
        self.addresses = addresses
        self._keep = (task, rows, x, x_rows, out, out_offsets)
        self._desc = _descriptor(addresses, rows, row_bytes, x, x_rows, out_offsets, out.ctypes.data)
        self._desc_address = self._desc.ctypes.data

    def run(self) -> bool:
        """Every item; True when every item's ``x`` was finite (else nothing written may be used)."""
        return _fan_out(self.task.address, self._desc, self._desc_address, self.n)


def matvec_group(
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, int],
    matrices: Sequence[ProjectionView],
    x: np.ndarray,
    x_rows: np.ndarray,
    out: np.ndarray,
) -> bool:
    """``out[i] = W_i @ x[x_rows[i]]`` for matrices ``W_i`` of one type and ``shape``, in one call
    (module docstring); the same bits as :func:`~aioexperts._compute.fused.linear` of each alone.

    Args:
        ggml_type: the type of every matrix.
        shape: ``(rows, cols)`` of every matrix, numpy order.
        matrices: each matrix's view (its ``data`` the raw ggml bytes, e.g. of a pinned slot,
            exactly ``rows * row_bytes`` long); kept alive by the caller during the call.
        x: ``(m, cols)`` float32, C-contiguous.
        x_rows: ``(len(matrices),)`` int64, the row of ``x`` each matrix takes, in ``0..m-1``.
        out: ``(len(matrices), rows)`` float32, C-contiguous.

    Returns:
        False, with nothing written that may be used, when no task serves the type (see
        :func:`product_task`) or a row of ``x`` is not finite: the caller takes ``linear``.

    Raises:
        FormatError: a matrix's byte count does not fit ``shape`` and the type.
        ConfigError: ``x``, ``x_rows`` or ``out`` of the wrong dtype, shape or layout.
    """
    task = product_task(ggml_type)
    if task is None:
        return False
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
    if n == 0:
        return True
    row_bytes = task.row_bytes(cols)
    for m in matrices:
        if m.data.nbytes != rows * row_bytes:
            raise FormatError(
                f"{ggml_type.name} matrix of shape {shape} needs {rows * row_bytes} bytes, got {m.data.nbytes}"
            )
    addresses = np.array([m.address for m in matrices], dtype=np.int64)
    offsets = 4 * rows * np.arange(n, dtype=np.int64)
    rows_each = np.full(n, rows, dtype=np.int64)
    desc = _descriptor(addresses, rows_each, row_bytes, x, np.ascontiguousarray(x_rows), offsets, out.ctypes.data)
    return _fan_out(task.address, desc, desc.ctypes.data, n)


#: weight rows of one item of :func:`matvec_split` at least
SPLIT_ROWS = 128


class SplitPlan:
    """A one-token product of one matrix cut into row ranges, prepared once (:func:`split_plan`):
    the fan-out's weight addresses, row counts and output byte offsets of every item, in a
    descriptor that each call copies (a plan is shared by the threads that use its matrix).

    Attributes:
        task: the type's fan-out task.
        rows: the matrix's rows (the output's length).
        cols: its columns (the width of ``x``).
        row_bytes: bytes per weight row.
        addresses, counts, out_offsets: int64 per item.
    """

    __slots__ = (
        "_bind",
        "_desc",
        "_n",
        "_x_rows",
        "addresses",
        "cols",
        "counts",
        "out_offsets",
        "row_bytes",
        "rows",
        "task",
    )

    def __init__(
        self,
        task: ProductTask,
        rows: int,
        cols: int,
        row_bytes: int,
        addresses: np.ndarray,
        counts: np.ndarray,
        out_offsets: np.ndarray,
    ) -> None:
        self.task, self.rows, self.cols, self.row_bytes = task, rows, cols, row_bytes
        self.addresses, self.counts, self.out_offsets = addresses, counts, out_offsets
        self._x_rows = x_rows = np.zeros(len(addresses), dtype=np.int64)  # every item takes x[0]
        desc = np.zeros(GROUP_DESC_SIZE, dtype=np.int64)
        desc[G_ADDRESSES] = addresses.ctypes.data
        desc[G_ROWS] = counts.ctypes.data
        desc[G_X_ROWS] = x_rows.ctypes.data
        desc[G_OUTS] = out_offsets.ctypes.data
        desc[G_ROW_BYTES] = row_bytes
        desc[G_COLS] = cols
        self._desc = desc
        self._n = len(addresses)
        self._bind = _fanout_module().bind_two  # a task exists, so the compiled kernels do

    def run(self, x: np.ndarray, out: np.ndarray) -> bool:
        """``out = W @ x[0]``; ``x`` ``(1, cols)`` and ``out`` ``(rows,)`` float32, C-contiguous (not
        checked: the caller made them). False when ``x`` is not finite (nothing usable written)."""
        desc = self._desc.copy()  # the plan is shared: each call its own descriptor
        return _fan_out(self.task.address, desc, self._bind(desc, G_X, x, G_OUT_BASE, out), self._n)


def split_plan(
    ggml_type: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, int], parts: int
) -> SplitPlan | None:
    """The :class:`SplitPlan` of the matrix ``raw`` (C-contiguous uint8 ggml bytes of ``shape``) in
    about ``parts`` ranges of at least :data:`SPLIT_ROWS` rows; None when no task serves the type.
    The plan holds ``raw``'s address: the caller keeps ``raw`` alive while it uses the plan.

    Raises:
        FormatError: the byte count does not fit ``shape`` and the type.
    """
    task = product_task(ggml_type)
    if task is None:
        return None
    rows, cols = shape
    row_bytes = task.row_bytes(cols)
    if raw.dtype != np.uint8 or not raw.flags.c_contiguous or raw.nbytes != rows * row_bytes:
        raise FormatError(f"{ggml_type.name} matrix of shape {shape} needs {rows * row_bytes} bytes, got {raw.nbytes}")
    return _row_ranges(task, raw.ctypes.data, rows, cols, max(1, min(parts, rows // SPLIT_ROWS)))


def _row_ranges(task: ProductTask, address: int, rows: int, cols: int, n: int) -> SplitPlan:
    """The plan of the matrix at ``address`` in ``n`` ranges of rows as even as they divide."""
    row_bytes = task.row_bytes(cols)
    bounds = np.array([rows * i // n for i in range(n + 1)], dtype=np.int64)
    return SplitPlan(task, rows, cols, row_bytes, address + bounds[:-1] * row_bytes, np.diff(bounds), 4 * bounds[:-1])


def matvec_split(
    ggml_type: GGMLQuantizationType,
    matrices: Sequence[tuple[np.ndarray, tuple[int, int]]],
    x: np.ndarray,
    outs: Sequence[np.ndarray],
    parts: int,
) -> bool:
    """``outs[k] = W_k @ x[0]`` for a few large matrices of one type, each cut into about ``parts``
    ranges of rows (at least :data:`SPLIT_ROWS` each) that are fan-out items (:class:`SplitPlan`, a
    fan-out per matrix): a large one-token product over every core. The same bits as
    :func:`~aioexperts._compute.fused.linear` of each alone (rows are independent).

    Args:
        ggml_type: the type of every matrix.
        matrices: ``(raw, (rows, cols))`` each: ``raw`` the C-contiguous uint8 ggml bytes, exactly
            ``rows * row_bytes`` long; every ``cols`` the width of ``x``.
        x: ``(1, cols)`` float32, C-contiguous.
        outs: ``(rows_k,)`` float32 C-contiguous per matrix.
        parts: items per matrix at most (e.g. the pool's threads times 4).

    Returns:
        False, with nothing written that may be used, when no task serves the type or ``x`` is not
        finite: the caller takes ``linear``.

    Raises:
        FormatError: a matrix's byte count does not fit its shape and the type.
        ConfigError: ``x`` or an output of the wrong dtype, shape or layout.
    """
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[0] != 1 or not x.flags.c_contiguous:
        raise ConfigError(f"matvec_split: x must be (1, cols) float32 C-contiguous, got {x.dtype}{x.shape}")
    for (raw, (rows, cols)), out in zip(matrices, outs, strict=True):
        if cols != x.shape[1]:
            raise ConfigError(f"matvec_split: a matrix of {cols} columns for x {x.shape}")
        if out.dtype != np.float32 or out.shape != (rows,) or not out.flags.c_contiguous:
            raise ConfigError(f"matvec_split: output {out.dtype}{out.shape} for {rows} rows")
        plan = split_plan(ggml_type, raw, (rows, cols), parts)
        if plan is None or not plan.run(x, out):
            return False
    return True


def warm_decode_kernels(types: Iterable[GGMLQuantizationType], f16_cache: bool) -> None:
    """Make, before a first decode step, what its whole-model pass compiles or loads on first use:
    the fan-out tasks of ``types`` (:func:`product_task`), the flash attention's task when the KV
    cache is F16, and the compiled RMSNorm, RoPE and finite-check kernels (the prepared attention
    step's and the fused residual-and-norm step's too).
    Blocking (a worker thread)."""
    for t in types:
        product_task(t)
    f32_task()  # the router's
    if f16_cache:
        _fused.warm_flash_task()
    from .norms import add_rms_norm, all_finite, rms_norm
    from .rope import apply_rope

    rms_norm(np.ones((1, 64), dtype=np.float32), None, 1e-6)
    row, weight = np.ones((1, 64), dtype=np.float32), np.ones(64, dtype=np.float32)
    weight.flags.writeable = False  # as the model's norm weights
    rms_norm(row, weight, 1e-6)  # a decode step's first-layer prediction, on the event loop: loaded here
    add_rms_norm(row, row, 0.0, weight, 1e-6)
    all_finite(row)
    ones = np.ones((1, 1), dtype=np.float32)
    apply_rope(np.ones((1, 1, 2), dtype=np.float32), ones, ones, RopeType.NEOX, 2)
    frozen_table = ones.copy()
    frozen_table.flags.writeable = False  # as RopeTable.cos_sin's views
    apply_rope(np.ones((1, 1, 2), dtype=np.float32), frozen_table, frozen_table, RopeType.NEOX, 2)
    norm_rope = _fused.compiled_kernel("rope", "norm_rope_heads")  # a prepared attention step's
    if norm_rope is not None:
        x, table = np.ones((1, 1, 2), dtype=np.float32), ones.copy()
        table.flags.writeable = False  # as RopeTable.cos_sin's views
        norm_rope(x, True, np.ones(2, np.float32), np.float32(1e-6), table, table, True, 2, x.copy(), x.copy())
    if _fused.backend().name != "numba":
        return
    # the prepared steps' small compiled calls, with the argument types a decode step gives them
    # (each a load from the kernel cache, several milliseconds, on its first call)
    desc = np.zeros(GROUP_DESC_SIZE, dtype=np.int64)
    fanout = _fanout_module()
    fanout.run_inline(0, int(desc.ctypes.data), 0)  # a pool of one thread runs every fan-out so (no item here)
    bind_two = fanout.bind_two  # SplitPlan.run, on a writable input and on a read-only one
    bind_two(desc, G_X, row, G_OUT_BASE, weight.copy())
    frozen = row.copy()
    frozen.flags.writeable = False
    bind_two(desc, G_X, frozen, G_OUT_BASE, weight.copy())
    weighted_sum = _fused.compiled_kernel("combine", "weighted_rows_sum")  # a RowStep's
    if weighted_sum is not None:
        weighted_sum(row.copy(), np.ones(1, dtype=np.float32), np.zeros(64, dtype=np.float32))
    table = np.zeros((3, 2), dtype=np.int64)
    table.flags.writeable = False  # as ExpertTable.addresses
    gather = _fused.compiled_kernel("combine", "gather_addresses")
    if gather is not None:
        gather(table, np.zeros(1, dtype=np.int64), np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64))
    tail = _fused.compiled_kernel("glu", "silu_mul_tail")
    if tail is not None:
        tail(row.copy(), row.copy(), row.copy(), row.copy())
    negate = _fused.compiled_kernel("glu", "negate_rows")
    if negate is not None:
        negate(row.copy(), row.copy())
    if f16_cache and _fused.flash_task_address() is not None:
        from .kernels import flash

        set_cache: Any = flash.set_flash_cache  # untyped (the kernels package)
        cache16 = np.zeros((2, 1, 32), dtype=np.float16).view(np.uint16)  # as a KV cache's bit view
        set_cache(np.zeros(flash.FLASH_DESC_SIZE, dtype=np.int64), cache16, cache16, 1, 0)
        # the one-call flash attention, which a decode takes where its heads do not fan out
        # (fused.flash_splits) even after a prefill whose attention did: a decode step's types
        q = np.zeros((1, 1, 32), dtype=np.float32)
        sinks = np.zeros(0, dtype=np.float32)
        attend: Any = flash.flash_attend_f16_bits
        attend(q, cache16[:1], cache16[:1], 0, np.float32(1.0), sinks, 0, q.copy(), 0, 1)
        # RowAttention's q/k norms, RoPE and cache writes, with a decode step's types
        weight32, v_heads = np.ones(32, dtype=np.float32), np.zeros((1, 32), dtype=np.float32)
        cos = np.ones((1, 16), dtype=np.float32)
        cos.flags.writeable = False  # as RopeTable.cos_sin's views
        store: Any = flash.norm_rope_store_kv
        store(
            q,
            True,
            weight32,
            q.copy(),
            q.copy(),
            q.copy(),
            True,
            weight32,
            q.copy(),
            q.copy(),
            v_heads,
            np.float32(1e-6),
            cos,
            cos,
            True,
            32,
            cache16,
            cache16,
            0,
        )
