"""A spin-wait outside the GIL: a compute-pool thread polls a shared counter before it sleeps.

Waking a thread that sleeps on a condition variable costs a futex wake-up and, on a virtual
machine, the exit and re-entry of an idle vCPU: a round trip of two wake-ups measured about
100 us on the 2-vCPU machines here. A decode token hands work between the pool's threads a few
hundred times (every split product, the attention heads, the experts of each layer), so the
wake-ups alone cost tens of milliseconds per token. ggml's thread pool spins on atomics between
its operations for the same reason (``ggml-cpu.c`` ``ggml_barrier``). :func:`spin_while_equal`
polls one element of an ``int64`` array with an acquire load (so the compiler cannot hoist it out
of the loop) and a ``pause`` per iteration on x86, for a bounded number of iterations, with the
GIL released.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit import kernel
from .simd import _element_pointer, _is_1d, _is_int, _target_features

__all__ = ("spin_while_equal",)

I64 = ir.IntType(64)


@intrinsic
def _load_acquire(typingctx: Any, ary: Any, index: Any) -> Any:
    """``ary[index]`` of a 1-D ``int64`` array as an atomic acquire load (re-read every time)."""
    if not (_is_1d(ary, types.int64) and _is_int(index)):
        return None
    sig = types.int64(ary, index)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], I64)
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def _cpu_relax(typingctx: Any) -> Any:
    """x86 ``pause`` (the spin-loop hint: lets the sibling hyper-thread run); nothing elsewhere."""
    sig = types.void()

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        if _target_features()[0].startswith(("x86_64", "i686", "i386")):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@kernel()
def spin_while_equal(signal: np.ndarray, index: int, seen: int, max_iters: int) -> int:
    """Poll ``signal[index]`` (1-D ``int64``) until it differs from ``seen``, at most ``max_iters``
    times; returns the value read last (``seen`` if it never changed). Runs without the GIL."""
    for _ in range(max_iters):
        value = _load_acquire(signal, index)
        if value != seen:
            return value
        _cpu_relax()
    return seen
