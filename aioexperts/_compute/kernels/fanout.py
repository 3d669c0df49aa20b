"""A fan-out that never takes the GIL: compiled tasks shared by the caller and a spinning worker.

A :meth:`~aioexperts._compute.pool.ComputePool.map` item runs Python on the worker that takes it,
so the worker must take the GIL first; the caller holds it until its own item enters a compiled
kernel, and the worker, asleep on the GIL by then, wakes 50-170 us later on the 2-vCPU virtual
machines here (a split flash attention call measured no faster than one thread). ggml's threads
never leave compiled code between operations (``ggml-cpu.c`` ``ggml_graph_compute_thread``).

Here a *task* is a C function ``int64 task(int64 desc, int64 item)`` (a ``numba.cfunc``): ``desc``
the address of an ``int64`` descriptor array, ``item`` an index; it returns 0 when the item went
right. :func:`fan_out` (the caller, without the GIL) publishes a task and its item count in a
control block, claims items one at a time, and waits until every claimed item has finished;
:func:`serve` (an idle compute-pool worker, without the GIL) spins on the same block and claims
items too. Everything a task reads is kept alive by the caller for the whole call.

Control block (``int64[CONTROL_SIZE]``): ``GEN`` the post counter; ``FN``, ``DESC``, ``N`` the
posted task; ``CLAIM`` = ``gen << CLAIM_BITS | next item``, taken by compare-and-swap, so a worker
that read an older post can never claim an item of a newer one; ``DONE`` items finished; ``STATUS``
the sum of their return values; ``SPINNERS`` workers in :func:`serve` now; ``HELPED`` items run
by workers in :func:`serve` so far. The caller writes the
task before it publishes ``GEN`` (release); a worker reads ``GEN`` (acquire) before the task. A
post's items are claimed only while some are left, and the caller posts again only once all have
finished, so the task a worker read is the one whose item it claimed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..jit import kernel
from .simd import _element_pointer, _is_1d, _is_int
from .spin import _cpu_relax, _load_acquire

__all__ = (
    "CONTROL_SIZE",
    "MAX_ITEMS",
    "HELPED",
    "SPINNERS",
    "bind_two",
    "fan_out",
    "finish",
    "new_control",
    "publish",
    "run_inline",
    "serve",
)

I64 = ir.IntType(64)

GEN, FN, DESC, N, CLAIM, DONE, STATUS, SPINNERS, HELPED = range(9)
#: int64 slots of a control block (the fields above, padded to two cache lines)
CONTROL_SIZE = 16
#: low bits of ``CLAIM`` that count items (at most 2**24 - 1 items per post)
CLAIM_BITS = 24
MAX_ITEMS = (1 << CLAIM_BITS) - 1


def _slot_and_value(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> tuple[Any, Any]:
    """The ``int64*`` of ``ary[index]`` and the third argument as an ``int64`` (``(ary, index, value)`` intrinsics)."""
    ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], I64)
    return ptr, context.cast(builder, args[2], signature.args[2], types.int64)


@intrinsic
def _atomic_add(typingctx: Any, ary: Any, index: Any, value: Any) -> Any:
    """``ary[index] += value`` atomically (sequentially consistent); the old value."""
    if not (_is_1d(ary, types.int64) and _is_int(index) and _is_int(value)):
        return None
    sig = types.int64(ary, index, value)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        return builder.atomic_rmw("add", *_slot_and_value(context, builder, signature, args), "seq_cst")

    return sig, codegen


@intrinsic
def _compare_swap(typingctx: Any, ary: Any, index: Any, expected: Any, new: Any) -> Any:
    """Atomically: if ``ary[index] == expected`` set it to ``new``; the value found (sequentially consistent)."""
    if not (_is_1d(ary, types.int64) and _is_int(index) and _is_int(expected) and _is_int(new)):
        return None
    sig = types.int64(ary, index, expected, new)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], I64)
        old = context.cast(builder, args[2], signature.args[2], types.int64)
        new = context.cast(builder, args[3], signature.args[3], types.int64)
        pair = builder.cmpxchg(ptr, old, new, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return sig, codegen


@intrinsic
def _store_release(typingctx: Any, ary: Any, index: Any, value: Any) -> Any:
    """``ary[index] = value`` as an atomic release store (every earlier store is visible first)."""
    if not (_is_1d(ary, types.int64) and _is_int(index) and _is_int(value)):
        return None
    sig = types.void(ary, index, value)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        ptr, value = _slot_and_value(context, builder, signature, args)
        builder.store_atomic(value, ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _call_task(typingctx: Any, fn: Any, desc: Any, item: Any) -> Any:
    """Call the C function at address ``fn``, ``int64 (int64 desc, int64 item)``."""
    if not (_is_int(fn) and _is_int(desc) and _is_int(item)):
        return None
    sig = types.int64(fn, desc, item)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(I64, [I64, I64])
        values = [context.cast(builder, a, t, types.int64) for a, t in zip(args, signature.args, strict=True)]
        ptr = builder.inttoptr(values[0], fnty.as_pointer())
        return builder.call(ptr, values[1:])

    return sig, codegen


@kernel(inline=True)
def _run_items(ctrl: np.ndarray, gen: int, helper: bool) -> None:
    """Claim and run items of post ``gen`` until none is left (or a newer post replaced it);
    ``helper``: count them in ``HELPED``."""
    fn = _load_acquire(ctrl, FN)
    desc = _load_acquire(ctrl, DESC)
    n = _load_acquire(ctrl, N)
    tag = gen << CLAIM_BITS
    while True:
        word = _load_acquire(ctrl, CLAIM)
        if word - (word & MAX_ITEMS) != tag:
            return
        item = word & MAX_ITEMS
        if item >= n:
            return
        if _compare_swap(ctrl, CLAIM, word, word + 1) != word:
            continue
        status = _call_task(fn, desc, item)
        if status != 0:
            _atomic_add(ctrl, STATUS, status)
        if helper:
            _atomic_add(ctrl, HELPED, 1)
        _atomic_add(ctrl, DONE, 1)


@kernel()
def publish(ctrl: np.ndarray, fn: int, desc: int, n: int) -> int:
    """Post ``fn(desc, i)`` for ``i`` in ``0..n-1`` on ``ctrl`` (workers in :func:`serve` start on
    it at once); returns the post's number, for :func:`finish`. One caller per control block at a
    time (the Python side holds a lock); ``0 <= n <= MAX_ITEMS``."""
    gen = ctrl[GEN] + 1
    ctrl[FN] = fn
    ctrl[DESC] = desc
    ctrl[N] = n
    ctrl[DONE] = 0
    ctrl[STATUS] = 0
    _store_release(ctrl, CLAIM, gen << CLAIM_BITS)
    _store_release(ctrl, GEN, gen)
    return gen


@kernel()
def finish(ctrl: np.ndarray, gen: int, n: int) -> int:
    """Run the items of post ``gen`` that are left, then wait until all ``n`` have finished; the sum
    of their return values. Runs without the GIL."""
    _run_items(ctrl, gen, False)
    while _load_acquire(ctrl, DONE) < n:
        _cpu_relax()
    return _load_acquire(ctrl, STATUS)


@kernel()
def fan_out(ctrl: np.ndarray, fn: int, desc: int, n: int) -> int:
    """:func:`publish` then :func:`finish`: every item run on this thread and the workers in
    :func:`serve` on ``ctrl``; the sum of the items' return values."""
    return finish(ctrl, publish(ctrl, fn, desc, n), n)


@kernel()
def bind_two(desc: np.ndarray, i: int, a: np.ndarray, j: int, b: np.ndarray) -> int:
    """``desc[i]`` = the address of ``a``'s data, ``desc[j]`` = ``b``'s; returns ``desc``'s own
    address. One compiled call for what ``.ctypes.data`` does three times in Python (a
    ``numpy._core._internal._ctypes`` object each: about 16 us apiece when a decode layer's
    weights have just flushed the caches, 4 us for this call)."""
    desc[i] = a.ctypes.data
    desc[j] = b.ctypes.data
    return desc.ctypes.data


@kernel()
def run_inline(fn: int, desc: int, n: int) -> int:
    """``fn(desc, i)`` for ``i`` in ``0..n-1`` on this thread alone; the sum of the return values."""
    status = 0
    for i in range(n):
        status += _call_task(fn, desc, i)
    return status


@kernel()
def serve(ctrl: np.ndarray, signal: np.ndarray, index: int, seen: int, max_iters: int) -> int:
    """A worker's idle spin (:func:`aioexperts._compute.kernels.spin.spin_while_equal` on
    ``signal[index]``) that also runs the items posted on ``ctrl`` meanwhile.

    Returns the value of ``signal[index]`` read last: ``seen`` when ``max_iters`` polls in a row
    found neither a post nor a change. Runs without the GIL.
    """
    _atomic_add(ctrl, SPINNERS, 1)
    last = _load_acquire(ctrl, GEN)
    _run_items(ctrl, last, True)  # a post that began before this spin (claims are tagged: never a stale one)
    value = seen
    idle = 0
    while idle < max_iters:
        value = _load_acquire(signal, index)
        if value != seen:
            break
        gen = _load_acquire(ctrl, GEN)
        if gen != last:
            last = gen
            _run_items(ctrl, gen, True)
            idle = 0
            continue
        _cpu_relax()
        idle += 1
    _atomic_add(ctrl, SPINNERS, -1)
    return value


def new_control() -> np.ndarray:
    """A zeroed control block."""
    return np.zeros(CONTROL_SIZE, dtype=np.int64)
