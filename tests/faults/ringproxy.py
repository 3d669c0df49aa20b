"""A fault-injecting stand-in for the ``liburing`` module, for the real ``UringBackend``.

``UringBackend`` reaches the wrapper only through the module-level name
``aioexperts._io.backends.uring.lu``. :meth:`RingFaults.install` puts a :class:`RingFaults` there
(install it *before* building the backend, so that its ``Cqe`` is the proxy's); every name it does
not override is the real module's. Typical use::

    faults = RingFaults()
    faults.fail_prep(4)                       # the 5th prep raises, after writing the entry
    faults.fail_submit(0, RuntimeError("x"))  # the 1st io_uring_submit raises, submits nothing
    faults.rewrite = faults.read_fault(ReadFault("eio", at="middle"))
    with faults.installed():
        backend = CheckedUring(files, slab, loop, depth)
        faults.watch(backend)                 # check every read entry that goes to the kernel
        ...
    assert faults.violations == []

Calls are counted from 0 per kind (``calls["prep"]`` counts ``io_uring_prep_readv`` and
``io_uring_prep_readv_fixed`` together). The proxy never drops a completion: rewrites may change a
result, duplicate an entry or reorder a walk.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import liburing

import aioexperts._io.backends.uring as uring_module
from faults.guard import SlotGuard
from faults.script import ReadFault

#: One completion as the proxy passes it on: (user_data, res), res < 0 is ``-errno``.
Completion = tuple[int, int]
READ_OPCODES = frozenset((int(liburing.io_uring_op.IORING_OP_READV), int(liburing.io_uring_op.IORING_OP_READV_FIXED)))


@dataclass
class _PrepFault:
    exc: Exception
    after_write: bool


class _Entry:
    """What ``cqe[0]`` returns through the proxy: like the wrapper's CQE, ``res`` raises for errors."""

    __slots__ = ("_res", "user_data")

    def __init__(self, user_data: int, res: int) -> None:
        self.user_data = user_data
        self._res = res

    @property
    def res(self) -> int:
        if self._res < 0:
            raise OSError(-self._res, os.strerror(-self._res))
        return self._res


class _CqeProxy:
    def __init__(self, real: Any) -> None:
        self.real = real
        self.current: _Entry | None = None

    def __getitem__(self, index: int) -> _Entry | None:
        return self.current


class RingFaults:
    """The ``liburing`` module with faults; see the module docstring.

    Attributes:
        calls: how many times each faultable call ran (``get_sqe``, ``prep``, ``nop``, ``submit``).
        batches: the user_data of the reads of each ``io_uring_submit`` call, in order.
        rewrite: ``f(completions) -> completions`` applied to each walk of the completion queue.
        violations: read entries that went to the kernel for a read the scheduler did not count as
            in flight (see :meth:`watch`), as text.
        enabled: False turns every scripted fault off (the counts go on).
    """

    def __init__(self, real: Any = liburing) -> None:
        self._real = real
        self.calls: Counter[str] = Counter()
        self._prep: dict[int, _PrepFault] = {}
        self._sqe_none: set[int] = set()
        self._submit: dict[int, Exception] = {}
        self._nop: dict[int, Exception] = {}
        self.register_buffers_error: Exception | None = None
        self.probe_error: Exception | None = None
        self.rewrite: Callable[[list[Completion]], list[Completion]] | None = None
        self.batches: list[list[int]] = []
        self._batch: list[int] = []
        self._queue: list[Any] = []  # entries handed out by get_sqe and not consumed by the kernel
        self._walked = 0
        self.violations: list[str] = []
        self.enabled = True
        self._backend: Any = None
        self._fail_calls: dict[str, tuple[Exception, bool]] = {}

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._real, name)
        failing = self.__dict__.get("_fail_calls", {}).get(name)
        if failing is None or not self.enabled:
            return real
        exc, after = failing

        def fail(*args: Any, **kwargs: Any) -> Any:
            del self._fail_calls[name]  # once
            if after:
                real(*args, **kwargs)
            raise exc

        return fail

    # -- scripting ------------------------------------------------------------------------------

    def fail_prep(self, nth: int, exc: Exception | None = None, *, after_write: bool = True) -> None:
        """The ``nth`` read prep raises ``exc``; ``after_write``: only after filling in the entry."""
        self._prep[nth] = _PrepFault(exc or TypeError("scripted: invalid argument"), after_write)

    def sqe_none(self, nth: int) -> None:
        """The ``nth`` ``io_uring_get_sqe`` returns None (the queue looks full)."""
        self._sqe_none.add(nth)

    def fail_submit(self, nth: int, exc: Exception) -> None:
        """The ``nth`` ``io_uring_submit`` raises ``exc`` and hands nothing to the kernel."""
        self._submit[nth] = exc

    def fail_nop(self, nth: int, exc: Exception | None = None) -> None:
        """The ``nth`` ``io_uring_prep_nop`` raises (the backend cannot neutralize an entry)."""
        self._nop[nth] = exc or RuntimeError("scripted: prep_nop failed")

    def fail_call(self, name: str, exc: Exception, *, after: bool = False) -> None:
        """The next call of the wrapper function ``name`` (one not overridden here, such as
        ``io_uring_register_eventfd`` or ``io_uring_queue_exit``) raises ``exc``; ``after``: only
        after the real call ran."""
        self._fail_calls[name] = (exc, after)

    def read_fault(self, fault: ReadFault) -> Callable[[list[Completion]], list[Completion]]:
        """A :attr:`rewrite` applying ``fault`` (its batches come from this proxy's submits)."""

        def rewrite(walk: list[Completion]) -> list[Completion]:
            out = []
            for user_data, res in walk:
                op = self._backend._ops.get(user_data) if self._backend is not None else None
                new = fault.result(op, res) if op is not None else None
                out.append((user_data, res if new is None else new))
            return out

        self._on_batch = fault.on_batch
        return rewrite

    @staticmethod
    def duplicate(
        user_data_of: Callable[[list[Completion]], int | None],
    ) -> Callable[[list[Completion]], list[Completion]]:
        """A :attr:`rewrite` that delivers the completion ``user_data_of(walk)`` picks twice."""

        def rewrite(walk: list[Completion]) -> list[Completion]:
            target = user_data_of(walk)
            out = []
            for item in walk:
                out.append(item)
                if item[0] == target:
                    out.append(item)
            return out

        return rewrite

    @staticmethod
    def reverse(walk: list[Completion]) -> list[Completion]:
        """A :attr:`rewrite` that delivers every walk in reverse order."""
        return walk[::-1]

    def watch(self, backend: SlotGuard) -> None:
        """Check, at each submit, that every read entry in the queue is a read ``backend`` has in flight."""
        self._backend = backend

    @contextlib.contextmanager
    def installed(self) -> Iterator[RingFaults]:
        """Put this proxy in place of ``liburing`` inside the io_uring backend module."""
        saved = uring_module.lu
        uring_module.lu = self
        try:
            yield self
        finally:
            uring_module.lu = saved

    def _count(self, kind: str) -> int:
        n = self.calls[kind]
        self.calls[kind] = n + 1
        return n

    _on_batch: Callable[[list[Any]], None] | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def io_uring_register_buffers(self, ring: Any, iovecs: Any, *args: Any) -> Any:
        if self.enabled and self.register_buffers_error is not None:
            raise self.register_buffers_error
        return self._real.io_uring_register_buffers(ring, iovecs, *args)

    def io_uring_get_probe_ring(self, ring: Any) -> Any:
        if self.enabled and self.probe_error is not None:
            raise self.probe_error
        return self._real.io_uring_get_probe_ring(ring)

    # -- submission -------------------------------------------------------------------------------

    def io_uring_get_sqe(self, ring: Any) -> Any:
        n = self._count("get_sqe")
        if self.enabled and n in self._sqe_none:
            return None
        sqe = self._real.io_uring_get_sqe(ring)
        if sqe is not None:
            self._queue.append(sqe)
        return sqe

    def _prep_read(self, real: Callable[..., Any], sqe: Any, *args: Any) -> Any:
        fault = self._prep.get(self._count("prep")) if self.enabled else None
        if fault is not None and not fault.after_write:
            raise fault.exc
        result = real(sqe, *args)
        if fault is not None:
            raise fault.exc
        return result

    def io_uring_prep_readv(self, sqe: Any, *args: Any) -> Any:
        return self._prep_read(self._real.io_uring_prep_readv, sqe, *args)

    def io_uring_prep_readv_fixed(self, sqe: Any, *args: Any) -> Any:
        return self._prep_read(self._real.io_uring_prep_readv_fixed, sqe, *args)

    def io_uring_prep_nop(self, sqe: Any) -> Any:
        n = self._count("nop")
        if self.enabled and n in self._nop:
            raise self._nop[n]
        return self._real.io_uring_prep_nop(sqe)

    def io_uring_sqe_set_data64(self, sqe: Any, user_data: int) -> Any:
        if user_data:
            self._batch.append(user_data)
        return self._real.io_uring_sqe_set_data64(sqe, user_data)

    def io_uring_submit(self, ring: Any) -> Any:
        n = self._count("submit")
        if self._batch:  # a submit that carries new reads
            self.batches.append(self._batch)
            if self._on_batch is not None and self._backend is not None:
                ops = [self._backend._ops[u] for u in self._batch if u in self._backend._ops]
                self._on_batch(ops)
            self._batch = []
        if self.enabled and n in self._submit:
            raise self._submit[n]
        self._check_queue()
        before = self._real.io_uring_sq_ready(ring)
        result = self._real.io_uring_submit(ring)
        consumed = before - self._real.io_uring_sq_ready(ring)
        del self._queue[: max(consumed, 0)]
        return result

    def _check_queue(self) -> None:
        """Every read entry about to reach the kernel must be a read the backend has in flight."""
        backend = self._backend
        if backend is None:
            return
        for sqe in self._queue:
            if int(sqe.opcode) not in READ_OPCODES:
                continue
            op = backend._ops.get(sqe.user_data)
            if op is None or not backend.is_live(op):
                self.violations.append(
                    f"a read entry (user_data {sqe.user_data}, {sqe.len} iovecs, fd {sqe.fd}) went to the kernel "
                    "for a read that is not in flight"
                )

    # -- completion -------------------------------------------------------------------------------

    def Cqe(self) -> _CqeProxy:  # noqa: N802 - the wrapper's name
        return _CqeProxy(self._real.Cqe())

    def CqeIter(self, ring: Any, cqe: _CqeProxy) -> Iterator[int]:  # noqa: N802 - the wrapper's name
        walk: list[Completion] = []
        for _ in self._real.CqeIter(ring, cqe.real):
            entry = cqe.real[0]
            try:
                res = entry.res
            except OSError as exc:
                res = -(exc.errno or errno.EIO)
            walk.append((entry.user_data, res))
        self._walked = len(walk)
        if self.enabled and self.rewrite is not None and walk:
            walk = self.rewrite(walk)
        for i, (user_data, res) in enumerate(walk):
            cqe.current = _Entry(user_data, res)
            yield i

    def io_uring_cq_advance(self, ring: Any, n: int) -> None:
        walked, self._walked = self._walked, 0
        self._real.io_uring_cq_advance(ring, walked)
