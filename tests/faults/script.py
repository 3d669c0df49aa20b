"""Scripted faults: one read's completion at a chosen place of a batch, and submits that fail midway."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aioexperts._io.backends.base import ReadOp, SubmitError
from aioexperts.testing import FakeBackend
from faults.guard import SlotGuard

#: Completion faults, by name: an errno (the read fails), or a rule for a short result.
ERRNO_KINDS = {"eio": errno.EIO, "eintr": errno.EINTR, "ecanceled": errno.ECANCELED}
SHORT_KINDS = ("short1", "half", "all_but_one", "zero")
REPEATED_KINDS = ("short1_repeatedly", "half_repeatedly", "all_but_one_repeatedly", "eintr_repeatedly")
READ_FAULT_KINDS = (*ERRNO_KINDS, *SHORT_KINDS, *REPEATED_KINDS)
POSITIONS = ("first", "middle", "last")


def position(at: str | int, n: int) -> int:
    """Index of ``at`` (``"first"``, ``"middle"``, ``"last"`` or an int) in a batch of ``n`` ops."""
    if isinstance(at, int):
        return min(at, n - 1)
    return {"first": 0, "middle": n // 2, "last": n - 1}[at]


@dataclass
class ReadFault:
    """Fault the completion of the read at position ``at`` of submit batch ``batch``.

    The read is remembered by its planned read, so the ``*_repeatedly`` kinds hit its re-reads
    too; the other kinds hit its first completion only.

    Attributes:
        kind: one of :data:`READ_FAULT_KINDS`.
        batch: which submit call (0 = the first).
        at: ``"first"``, ``"middle"``, ``"last"`` or an index.
        hits: how many completions were faulted.
    """

    kind: str
    batch: int = 0
    at: str | int = "first"
    hits: int = 0
    _target: tuple[Any, Any] | None = field(default=None, repr=False)
    _batches_seen: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in READ_FAULT_KINDS:
            raise ValueError(f"unknown read fault {self.kind!r}")

    def on_batch(self, ops: Sequence[ReadOp]) -> None:
        """Call with the reads of every submit, in order; picks the target in batch ``batch``."""
        if self._batches_seen == self.batch and ops:
            op = ops[position(self.at, len(ops))]
            self._target = op.context
        self._batches_seen += 1

    def result(self, op: ReadOp, n: int) -> int | None:
        """The faulted result (bytes, or ``-errno``) for ``op`` whose real result is ``n``; None: no fault."""
        target = self._target
        if target is None or op.context is None or op.context[0] is not target[0] or op.context[1] is not target[1]:
            return None
        repeated = self.kind.endswith("_repeatedly")
        if self.hits and not repeated:
            return None
        if n < 0:
            return None
        kind = self.kind.removesuffix("_repeatedly")
        self.hits += 1
        if kind in ERRNO_KINDS:
            return -ERRNO_KINDS[kind]
        if kind == "zero":
            return 0
        if kind == "short1":
            return min(1, n)
        if kind == "half":
            return n // 2
        return max(n - 1, 0)  # all_but_one


def as_exception(res: int) -> OSError:
    return OSError(-res, os.strerror(-res))


class ScriptedFake(FakeBackend):
    """A fake that can fail a completion (:class:`ReadFault`) or a whole submit midway.

    Args:
        read_fault: a completion fault, or None.
        submit_fault: ``(batch, at, exception)``: submit call ``batch`` takes the reads before
            position ``at`` and then raises ``SubmitError`` with ``exception`` as the cause.
        raw_submit: with ``submit_fault``, raise ``exception`` itself instead of a ``SubmitError``
            (a backend outside the contract, which the scheduler must survive as well: it counts
            the reads taken by the backend's ``in_flight``).
        other arguments: as :class:`FakeBackend`.
    """

    def __init__(
        self,
        *args: Any,
        read_fault: ReadFault | None = None,
        submit_fault: tuple[int, str | int, Exception] | None = None,
        raw_submit: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, fault=self._fault, **kwargs)
        self.read_fault = read_fault
        self.submit_fault = submit_fault
        self.raw_submit = raw_submit
        self._calls = 0

    @property
    def submit_calls(self) -> int:
        """``submit`` calls so far (the next one has this index in ``submit_fault``)."""
        return self._calls

    def _fault(self, op: ReadOp) -> int | Exception | None:
        if self.read_fault is None:
            return None
        res = self.read_fault.result(op, op.n_bytes)
        if res is None:
            return None
        return as_exception(res) if res < 0 else res

    def submit(self, ops: Sequence[ReadOp]) -> None:
        call, self._calls = self._calls, self._calls + 1
        if self.read_fault is not None:
            self.read_fault.on_batch(ops)
        if self.submit_fault is not None and self.submit_fault[0] == call and ops:
            _, at, exc = self.submit_fault
            taken = position(at, len(ops))
            if taken:
                super().submit(ops[:taken])
            if self.raw_submit:
                raise exc
            raise SubmitError(f"scripted: took {taken} of {len(ops)} reads", taken) from exc
        super().submit(ops)


class FaultyFake(SlotGuard, ScriptedFake):
    """:class:`ScriptedFake` under the slot-ownership guard."""

    def ops_for_slot(self, slot: int) -> list[ReadOp]:
        return [op for op in self.pending if op.slot == slot]
