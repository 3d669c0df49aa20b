"""The interface every read backend implements, and its submit / completion contract.

Contract between the scheduler and a backend (every call on the loop thread unless noted):

- :meth:`IOBackend.submit` *takes* a prefix of its ops: every taken op gets exactly one
  completion, delivered to the sink later (never from inside ``submit``), and until then the
  backend may write into the op's slot range. When it cannot take every op it raises
  :class:`SubmitError` whose :attr:`~SubmitError.taken` says how many ops, from the front, it took;
  the others were not started and never will be.
- A completion is the number of bytes read (``0 <= n <= n_bytes``) or the exception that failed
  the read (an ``OSError`` from the kernel, or any other exception the backend met while reading).
- A backend whose :attr:`IOBackend.ends_batches` is True calls the ``batch_end`` callback given to
  :meth:`IOBackend.set_sink` after each batch of completions it delivered together (one reap of
  the ring, one wake-up of the thread pool), on the loop thread and outside ``submit``: the
  scheduler then submits the reads those completions made room for at once, in the same loop
  tick, rather than one tick later; or, for a backend whose :attr:`IOBackend.flush_at_batch_end`
  is False, at the end of that loop tick, in one submission with the reads of the requests those
  completions woke.
- A backend that reaps in batches (the raw ring) hands a batch of completions to the handler
  given to :meth:`IOBackend.set_batch_sink` in one call instead of one sink call per op, while
  the sink set is the one that handler stands for (the same completions, in the same order).
- A backend that can wake the loop once per batch of completions rather than once per
  completion asks the hint given to :meth:`IOBackend.set_wake_hint` how many completions it may
  wait for (the fewest after which a waiting request can go on); any count is correct (it only
  delays wake-ups), 1 is what a backend without batching does.
- Set-up (the constructor) touches no event loop and may run in a worker thread; :meth:`attach`
  starts delivering completions (loop thread); :meth:`detach` stops watching the loop (loop
  thread); :meth:`close` releases the rest and may run in a worker thread once detached.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from ..files import ShardFiles
from ..loop import LoopAdapter
from ..slab import Slab

__all__ = ("BatchSink", "CompletionSink", "IOBackend", "ReadOp", "ReadResult", "SubmitError")

log = logging.getLogger("aioexperts")


class ReadOp:
    """One read of ``n_bytes`` at ``file_offset`` of shard ``shard`` into ``slot`` at ``slot_offset``.

    With direct I/O, ``file_offset``, ``n_bytes`` and ``slot_offset`` are multiples of the
    alignment. ``context`` belongs to whoever submitted the op.
    """

    __slots__ = ("context", "file_offset", "n_bytes", "shard", "slot", "slot_offset", "submitted_ns")

    def __init__(
        self,
        shard: int,
        file_offset: int,
        n_bytes: int,
        slot: int,
        slot_offset: int,
        context: Any = None,
        submitted_ns: int = 0,
    ) -> None:
        self.shard = shard
        self.file_offset = file_offset
        self.n_bytes = n_bytes
        self.slot = slot
        self.slot_offset = slot_offset
        self.context = context
        self.submitted_ns = submitted_ns

    def __repr__(self) -> str:
        return (
            f"ReadOp(shard={self.shard}, file_offset={self.file_offset}, n_bytes={self.n_bytes}, "
            f"slot={self.slot}, slot_offset={self.slot_offset})"
        )


#: What a read completes with: the bytes read (``0 <= n <= n_bytes``) or the exception that failed it.
ReadResult = int | Exception

#: Called on the loop thread exactly once per taken op.
CompletionSink = Callable[[ReadOp, ReadResult], None]
#: Called on the loop thread with a batch of completions: ``(ops, results)``, one result per op.
BatchSink = Callable[[list[ReadOp], list[ReadResult]], None]


class SubmitError(Exception):
    """A backend took only the first :attr:`taken` ops of a :meth:`IOBackend.submit` batch.

    The cause (the ``OSError`` of ``io_uring_submit``, a ``RuntimeError`` of the wrapper, ...) is
    attached as ``__cause__``. Ops ``[:taken]`` complete through the sink as usual (possibly with
    an error); ops ``[taken:]`` were never started: their slot ranges are untouched.

    Attributes:
        taken: the number of ops, from the front of the batch, that the backend took.
    """

    def __init__(self, message: str, taken: int) -> None:
        super().__init__(message)
        self.taken = taken


class IOBackend(ABC):
    """Reads into slab slots and reports each completion to a sink on the loop thread.

    The caller (the scheduler) bounds the ops in flight to ``depth``, submits from the loop
    thread only, and calls :meth:`close` only once :attr:`in_flight` is 0.

    Subclasses count an op in ``_in_flight`` when they take it and hand every completion to
    :meth:`_deliver`, which uncounts it.
    """

    #: short name reported in statistics: ``io_uring``, ``threads``, ``fake``.
    name: ClassVar[str]
    #: True for a backend that calls ``batch_end`` after each batch of completions (module docstring).
    ends_batches: ClassVar[bool] = False
    #: With :attr:`ends_batches`: the scheduler submits the reads a batch of completions made room
    #: for at the batch's end (True), or at the end of that loop tick, in one submission with the
    #: reads the requests it woke ask for (False: one submission per batch instead of two).
    flush_at_batch_end: ClassVar[bool] = True

    def __init__(self, files: ShardFiles, slab: Slab, loop: LoopAdapter, depth: int) -> None:
        self.files = files
        self.slab = slab
        self.loop = loop
        self.depth = depth
        self._sink: CompletionSink | None = None
        self._batch_end: Callable[[], None] | None = None
        self._batch_sink: BatchSink | None = None
        self._batch_sink_for: CompletionSink | None = None
        self._wake_hint: Callable[[], int] | None = None
        self._in_flight = 0
        self._attached = False
        self._failed: list[tuple[ReadOp, Exception]] = []  # failed reads whose completion is due
        self._failed_scheduled = False
        self._submit_scheduled = False

    def set_sink(self, sink: CompletionSink, batch_end: Callable[[], None] | None = None) -> None:
        """Where completions go, and (for a backend that :attr:`ends_batches`) what to call after
        each batch of them; set once before the first :meth:`submit`."""
        self._sink = sink
        self._batch_end = batch_end

    def set_batch_sink(self, batch_sink: BatchSink, stands_for: CompletionSink) -> None:
        """A handler of a whole batch of completions, ``batch_sink(ops, results)``, equivalent to
        calling ``stands_for`` once per op in order; a backend that reaps in batches
        (:meth:`_deliver_reaped`) calls it instead of the per-op sink, but only while the sink set
        by :meth:`set_sink` is still ``stands_for`` (a wrapper set in its place sees every op).
        It must not raise."""
        self._batch_sink = batch_sink
        self._batch_sink_for = stands_for

    def set_wake_hint(self, hint: Callable[[], int]) -> None:
        """How many completions the loop may wait for before it must be woken (loop thread; at
        least 1; it must not raise). Backends that wake per completion ignore it."""
        self._wake_hint = hint

    @property
    def in_flight(self) -> int:
        """Ops taken whose completion has not been delivered yet."""
        return self._in_flight

    @property
    def attached(self) -> bool:
        """True between :meth:`attach` and :meth:`detach`."""
        return self._attached

    @property
    def direct_io(self) -> bool:
        """True when reads bypass the page cache (``O_DIRECT``)."""
        return self.files.direct_io

    def features(self) -> dict[str, Any]:
        """Backend details for statistics (e.g. registered buffers)."""
        return {}

    def prepare(self, shapes: Iterable[tuple[int, int]]) -> None:  # noqa: B027 - optional, no-op by default
        """Build ahead whatever per-read state the backend keeps for ``(slot_offset, n_bytes)`` reads
        into every slot (blocking; called once before :meth:`attach`, off the loop)."""

    def attach(self) -> None:
        """Start delivering completions through the event loop (loop thread only; idempotent).

        The constructor touches no event loop, so it can run in a worker thread; this is the part
        that must run on the loop thread (``add_reader`` of an eventfd, for example).
        """
        self._attached = True

    def detach(self) -> None:
        """Stop watching the event loop (loop thread only; idempotent).

        Completions that arrive afterwards are not delivered; call it only once nothing is in
        flight, just before :meth:`close`.
        """
        self._attached = False

    @abstractmethod
    def submit(self, ops: Sequence[ReadOp]) -> None:
        """Start every op in ``ops`` as one submission (loop thread only).

        Raises:
            SubmitError: only the first ``taken`` ops were started (see the module docstring).
        """

    @abstractmethod
    def close(self) -> None:
        """Release the backend's resources; only when nothing is in flight.

        Idempotent, and safe to call again after a close that was interrupted by an exception:
        each resource is released at most once and every release is attempted. Detaches first
        when still attached (then it must run on the loop thread); once detached, it may run in a
        worker thread.

        Raises:
            RuntimeError: reads are still in flight, or the backend is attached and this is not
                the loop thread.
        """

    def _check_closable(self) -> None:
        if self._in_flight:
            raise RuntimeError(f"closing the {self.name} backend with {self._in_flight} reads in flight")
        if self._attached:
            if not self.loop.is_current():
                raise RuntimeError(f"the {self.name} backend is attached: detach() it on the loop thread first")
            self.detach()

    # -- deferred work of the queue-based backends (loop thread) ---------------------------------

    def _fail_later(self, failed: Sequence[tuple[ReadOp, Exception]]) -> None:
        """Fail reads an earlier :meth:`submit` reported taken, through the sink on a later tick
        (never from inside ``submit``: the contract). One ``call_soon`` however many pile up."""
        self._failed.extend(failed)
        if failed and not self._failed_scheduled:
            self._failed_scheduled = True
            self.loop.call_soon(self._deliver_failed)

    def _deliver_failed(self) -> None:
        self._failed_scheduled = False
        failed, self._failed = self._failed, []
        for op, exc in failed:
            self._deliver(op, exc)

    def _schedule_submit(self) -> None:
        """Hand the entries still queued to the kernel on a later tick (once however often asked)."""
        if not self._submit_scheduled:
            self._submit_scheduled = True
            self.loop.call_soon(self._submit_later)

    def _submit_later(self) -> None:
        self._submit_scheduled = False
        if self._attached:  # detached: close() may be running in a worker thread
            self._submit_pending()

    def _submit_pending(self) -> None:  # noqa: B027 - only the backends that queue entries override it
        """Submit what :meth:`_schedule_submit` left queued (the backends that keep a queue)."""

    def _end_batch(self) -> None:
        """Call ``batch_end`` once a batch of completions was delivered (loop thread; never raises)."""
        batch_end = self._batch_end
        if batch_end is not None:
            try:
                batch_end()
            except Exception:  # the scheduler's never raises; a custom one must not stop the reaping
                log.exception("the end of a batch of completions failed")

    def _deliver_reaped(self, ops: list[ReadOp], results: list[ReadResult]) -> None:
        """Deliver the completions of ``ops`` (one result each): one call of the batch sink when it
        stands for the current sink (:meth:`set_batch_sink`), else :meth:`_deliver` per op."""
        batch_sink = self._batch_sink
        if batch_sink is not None and self._sink == self._batch_sink_for:
            self._deliver_together(batch_sink, ops, results)
            return
        deliver = self._deliver
        for op, result in zip(ops, results, strict=True):
            deliver(op, result)

    def _deliver_together(self, batch_sink: BatchSink, ops: list[ReadOp], results: list[ReadResult]) -> None:
        """Hand ``ops`` and their results to ``batch_sink`` in one call (:meth:`_deliver` for a batch)."""
        self._in_flight -= len(ops)
        try:
            batch_sink(ops, results)
        except Exception:  # the scheduler's never raises
            log.exception("handling a batch of %d completions failed", len(ops))

    def _deliver(self, op: ReadOp, result: ReadResult) -> None:
        self._in_flight -= 1
        assert self._sink is not None
        try:
            self._sink(op, result)
        except Exception:  # the scheduler's sink never raises; a custom one must not lose the batch
            log.exception("handling the completion of %r failed", op)
