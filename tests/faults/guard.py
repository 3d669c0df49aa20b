"""Backends that check slot ownership on every read they take."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from aioexperts._io.backends.base import IOBackend, ReadOp, ReadResult, SubmitError
from aioexperts._io.backends.rawring import RawUringBackend
from aioexperts._io.backends.uring import UringBackend
from aioexperts.testing import FakeBackend


class SlotGuard(IOBackend):
    """Mixin: record the reads a backend takes; a read into a slot another load owns is a violation.

    A read counts from the moment it is handed to ``submit`` (tentatively: the kernel may see it
    inside the call) until its completion is delivered; reads ``submit`` reports as not taken
    (``SubmitError.taken``) are forgotten at once. A ``submit`` call on a backend that was already
    closed is a violation too (nothing may be submitted after close). ``after_submit``,
    ``before_deliver`` and ``after_deliver`` hooks let a test act at those points (close the cache,
    start a task, for example).

    ``close()`` calls are counted, and one that starts while another runs (two releases of the
    same backend at once, from two threads) is a violation; ``close_delay`` (seconds) makes each
    ``close()`` take that long, so that such an overlap cannot go unseen.

    Attributes:
        violations: every broken rule, as text; a test asserts it stays empty.
        submitted: the ops of each submit call that the backend took.
        close_calls: ``close()`` calls so far.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slot_loads: dict[int, dict[int, int]] = {}  # slot -> id(load) -> reads in flight
        self.live: dict[int, ReadOp] = {}  # id(op) -> op, for every read taken and not delivered
        self.submitted: list[list[ReadOp]] = []
        self.violations: list[str] = []
        self.after_submit: Callable[[Sequence[ReadOp], int], None] | None = None
        self.before_deliver: Callable[[ReadOp, ReadResult], None] | None = None
        self.after_deliver: Callable[[ReadOp, ReadResult], None] | None = None
        self.close_calls = 0
        self.close_delay = 0.0
        self._closing = 0
        self._close_lock = threading.Lock()

    def _own(self, op: ReadOp) -> None:
        load = id(op.context[0])
        owners = self.slot_loads.setdefault(op.slot, {})
        if any(k != load for k in owners):
            self.violations.append(f"slot {op.slot} reused while another load reads into it: {op}")
        owners[load] = owners.get(load, 0) + 1
        self.live[id(op)] = op

    def _disown(self, op: ReadOp) -> None:
        if self.live.pop(id(op), None) is None:
            self.violations.append(f"a completion for a read that is not in flight: {op}")
            return
        owners = self.slot_loads[op.slot]
        load = id(op.context[0])
        owners[load] -= 1
        if owners[load] == 0:
            del owners[load]

    def is_live(self, op: ReadOp) -> bool:
        """True while ``op`` is taken and its completion not delivered."""
        return id(op) in self.live

    @property
    def is_closed(self) -> bool:
        """True once the backend was closed (the fake's ``closed``, io_uring's ``_closed``)."""
        return bool(getattr(self, "closed", False) or getattr(self, "_closed", False))

    def submit(self, ops: Sequence[ReadOp]) -> None:
        ops = list(ops)
        if self.is_closed:
            self.violations.append(f"{len(ops)} reads submitted to a closed backend: {ops[:3]}")
        for op in ops:
            self._own(op)
        before = self.in_flight
        taken = len(ops)
        try:
            super().submit(ops)  # type: ignore[safe-super]
        except SubmitError as exc:
            taken = exc.taken
            raise
        except Exception:
            taken = self.in_flight - before
            raise
        finally:
            for op in ops[taken:]:
                self._disown(op)
            self.submitted.append(ops[:taken])
            if self.after_submit is not None:
                self.after_submit(ops, taken)

    def _deliver(self, op: ReadOp, result: ReadResult) -> None:
        if self.before_deliver is not None:
            self.before_deliver(op, result)
        self._disown(op)
        super()._deliver(op, result)
        if self.after_deliver is not None:
            self.after_deliver(op, result)

    def _deliver_together(self, batch_sink: Any, ops: list[ReadOp], results: list[ReadResult]) -> None:
        # a reap handed to the scheduler in one call: every op's completion is delivered by it
        before = self.before_deliver
        for op, result in zip(ops, results, strict=True):
            if before is not None:
                before(op, result)
                before = self.before_deliver
            self._disown(op)
        super()._deliver_together(batch_sink, ops, results)  # type: ignore[misc]
        if self.after_deliver is not None:
            for op, result in zip(ops, results, strict=True):
                if self.after_deliver is not None:
                    self.after_deliver(op, result)

    def close(self) -> None:
        with self._close_lock:
            self.close_calls += 1
            self._closing += 1
            if self._closing > 1:
                self.violations.append("close() entered while another close() of the backend was running")
        try:
            if self.close_delay:
                time.sleep(self.close_delay)
            super().close()  # type: ignore[safe-super]
        finally:
            with self._close_lock:
                self._closing -= 1

    def owners(self, slot: int) -> int:
        """Loads with a read in flight into ``slot``."""
        return len(self.slot_loads.get(slot, {}))


class CheckedFake(SlotGuard, FakeBackend):
    """A :class:`FakeBackend` that fails loudly if a read targets a slot another load is still reading into."""

    def ops_for_slot(self, slot: int) -> list[ReadOp]:
        return [op for op in self.pending if op.slot == slot]


class CheckedUring(SlotGuard, UringBackend):
    """The real io_uring backend with slot-ownership checks (pair it with ``RingFaults`` for faults)."""


class CheckedRawUring(SlotGuard, RawUringBackend):
    """The raw-syscall io_uring backend with slot-ownership checks."""


def checked_factory(cls: type[IOBackend], holder: dict[str, Any], **kwargs: Any) -> Callable[..., IOBackend]:
    """A backend factory (``backend=`` of ``aioexperts.open``) that keeps the backend in ``holder["backend"]``."""

    def factory(files: Any, slab: Any, loop: Any, depth: int) -> IOBackend:
        holder["backend"] = backend = cls(files, slab, loop, depth, **kwargs)
        return backend

    return factory
