"""A scriptable backend for tests of ordering, short reads, errors and cancellation.

It reads with a plain ``pread`` on the loop thread (fine for small test files) and delivers each
completion when the test says so, or on the next loop tick in a chosen order.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._io.backends.base import IOBackend, ReadOp, SubmitError
from .._io.files import ShardFiles
from .._io.loop import LoopAdapter
from .._io.slab import Slab

__all__ = ("FakeBackend",)

#: ``fault(op)`` returns None for a full read, an int ``n`` for a read that stops after ``n``
#: bytes, or an exception (an ``OSError`` usually) to fail the read.
Fault = Callable[[ReadOp], "int | Exception | None"]


class FakeBackend(IOBackend):
    """Completes reads in a scripted way.

    Args:
        auto: deliver every pending op on the next loop tick; False to deliver only through
            :meth:`complete` / :meth:`complete_all`.
        order: ``"fifo"``, ``"reverse"`` or ``"shuffle"`` (seeded) for automatic delivery.
        fault: optional per-op override of the result (see :data:`Fault`).
        delay: with ``auto``, deliver each submission's reads this many seconds after it (a device
            of known latency, for stall timing; a timer thread hands them to the loop).
        read: False to deliver every read as complete without reading anything (the slot keeps
            whatever it held): the store's own CPU per read with no I/O, for ``bench/read_cpu.py``.
            A ``fault`` still sets the result.

    Attributes:
        pending: submitted ops not completed yet.
        batches: the number of ops in each :meth:`submit` call.
        completed: every op delivered, in delivery order, with its result.
    """

    name = "fake"

    def __init__(
        self,
        files: ShardFiles,
        slab: Slab,
        loop: LoopAdapter,
        depth: int,
        *,
        auto: bool = True,
        order: str = "fifo",
        fault: Fault | None = None,
        seed: int = 0,
        delay: float = 0.0,
        read: bool = True,
    ) -> None:
        super().__init__(files, slab, loop, depth)
        self.auto = auto
        self.order = order
        self.fault = fault
        self.pending: list[ReadOp] = []
        self.batches: list[int] = []
        self.completed: list[tuple[ReadOp, int | Exception]] = []
        self.closed = False
        self._rng = random.Random(seed)
        self._tick_scheduled = False
        if not delay >= 0.0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay!r}")
        self.delay = float(delay)
        self.read = read

    def features(self) -> dict[str, Any]:
        return {"order": self.order, "auto": self.auto, "read": self.read}

    def submit(self, ops: Sequence[ReadOp]) -> None:
        if self.closed:
            raise SubmitError("submit on a closed fake backend", 0)
        assert self._in_flight + len(ops) <= self.depth, "the scheduler exceeded the depth bound"
        self.batches.append(len(ops))
        self.pending.extend(ops)
        self._in_flight += len(ops)
        if self.auto and self.delay > 0:
            batch = list(ops)
            timer = threading.Timer(self.delay, self.loop.call_soon_threadsafe, (lambda: self._deliver_batch(batch),))
            timer.daemon = True
            timer.start()
        elif self.auto and not self._tick_scheduled:
            self._tick_scheduled = True
            self.loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._tick_scheduled = False
        self.complete_all()

    def _deliver_batch(self, ops: list[ReadOp]) -> None:
        for op in ops:
            if op in self.pending:
                self.pending.remove(op)
                self._complete(op, None)

    def complete_all(self) -> None:
        """Deliver every pending op, in :attr:`order`."""
        ops, self.pending = self.pending, []
        if self.order == "reverse":
            ops.reverse()
        elif self.order == "shuffle":
            self._rng.shuffle(ops)
        for op in ops:
            self._complete(op, None)

    def complete(self, op: ReadOp, result: int | Exception | None = None) -> None:
        """Deliver one pending op now: a full read, ``result`` bytes of it, or ``result`` as error."""
        self.pending.remove(op)
        self._complete(op, result)

    def _complete(self, op: ReadOp, result: int | Exception | None) -> None:
        if result is None and self.fault is not None:
            result = self.fault(op)
        if not self.read:
            result = op.n_bytes if result is None else result
        elif not isinstance(result, Exception):
            with self.slab.writable_view(op.slot, op.slot_offset, op.n_bytes) as view:
                n = os.preadv(self.files.fds[op.shard], [view], op.file_offset)
                if result is not None and result < n:
                    n = result
                    view[n:] = b"\xee" * (op.n_bytes - n)  # what was "not read" must be read again
            result = n
        self.completed.append((op, result))
        self._deliver(op, result)

    def close(self) -> None:
        if self.closed:
            return
        self._check_closable()
        self.closed = True
