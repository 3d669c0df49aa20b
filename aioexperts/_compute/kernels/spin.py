"""A short spin-wait without the GIL, for the compute pool's hand-offs.

A worker that goes to sleep on a condition variable is woken by the kernel, which on a virtual
machine with an idle vCPU takes tens of microseconds (a halted vCPU is woken by an interrupt). The
pool's fan-outs come every few hundred microseconds in a decode step, so a thread that has just
finished its part spins briefly on a counter before it sleeps, as ggml's CPU threads do
(``ggml_graph_compute_thread``'s ``ggml_barrier`` and poll loop): :func:`spin_while` polls one
``int64`` with an atomic (acquire) load and a ``pause`` between polls, with the GIL released.
"""

from __future__ import annotations

import platform
import time
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit import kernel

__all__ = ("pauses_per_microsecond", "spin_while")

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@intrinsic
def _load_acquire(typingctx: Any, ary: Any, index: Any) -> Any:
    """``ary[index]`` of a 1-D int64 array as an atomic acquire load (never hoisted out of a loop)."""
    sig = types.int64(ary, index)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        array = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, array, [args[1]])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def _pause(typingctx: Any) -> Any:
    """x86 ``pause`` (a spin-loop hint); nothing elsewhere."""
    sig = types.void()

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        if _X86:
            module = builder.module
            name = "llvm.x86.sse2.pause"
            fn = module.globals.get(name) or ir.Function(module, ir.FunctionType(ir.VoidType(), []), name)
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@kernel(exact=True)
def spin_while(flag: np.ndarray, value: int, max_pauses: int) -> int:  # pragma: no cover - compiled
    """Spin while ``flag[0] == value``, at most ``max_pauses`` polls (GIL released).

    Args:
        flag: ``(>=1,)`` int64, written by another thread.
        value: the value to wait out.
        max_pauses: polls before giving up.

    Returns:
        The polls left when ``flag[0]`` changed (> 0), or 0 when it did not change in time.
    """
    for i in range(max_pauses):
        if _load_acquire(flag, 0) != value:
            return max_pauses - i
        _pause()
    return 0


_rate: list[float] = []


def pauses_per_microsecond() -> float:
    """Polls of :func:`spin_while` per microsecond on this CPU (measured once, about 1 ms)."""
    if not _rate:
        flag = np.zeros(1, np.int64)
        spin_while(flag, 0, 100)  # compiled
        n = 10_000
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            spin_while(flag, 0, n)
            best = min(best, time.perf_counter() - t0)
        _rate.append(n / max(best * 1e6, 1e-3))
    return _rate[0]
