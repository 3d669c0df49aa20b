"""A bounded thread pool of ``os.preadv`` calls: the fallback where io_uring is not available."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

from ..files import ShardFiles
from ..loop import LoopAdapter
from ..slab import Slab
from .base import IOBackend, ReadOp, ReadResult, SubmitError

__all__ = ("ThreadBackend",)

log = logging.getLogger("aioexperts")


class ThreadBackend(IOBackend):
    """Each op is one ``preadv`` straight into slot memory on a worker thread.

    Completions are handed back to the loop in batches (one wake-up for all that finished since
    the last one), so the loop pays one ``call_soon_threadsafe`` per batch, not per read, and the
    scheduler takes each batch in one call (its batch sink, :meth:`IOBackend.set_batch_sink`). Whatever
    a read raises (``OSError``, ``ValueError`` from a closed slab, ``MemoryError``) is its result.
    Submitting is one ``SimpleQueue.put`` per read to the worker threads (started on the first
    submit): no ``Future`` per read, which cost the loop thread about 15 us a read (a third of an
    expert's Python on the miss path, ``bench/profile_miss_path.py``).

    Args:
        n_threads: worker threads (default: ``min(depth, 8)``); reads queue beyond that.
    """

    name = "threads"
    ends_batches = True

    def __init__(
        self, files: ShardFiles, slab: Slab, loop: LoopAdapter, depth: int, n_threads: int | None = None
    ) -> None:
        super().__init__(files, slab, loop, depth)
        self.n_threads = n_threads or min(depth, 8)
        self._queue: queue.SimpleQueue[ReadOp | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._done_ops: list[ReadOp] = []  # completed since the last drain, with their results
        self._done_results: list[ReadResult] = []
        self._wake_pending = False
        self._closed = False

    def features(self) -> dict[str, Any]:
        return {"threads": self.n_threads}

    def submit(self, ops: Sequence[ReadOp]) -> None:
        if self._closed:
            raise SubmitError("submit on a closed thread backend", 0)
        if len(self._threads) < self.n_threads:
            try:
                self._start_threads()
            except Exception as exc:  # no thread could start: nothing was taken
                if not self._threads:
                    raise SubmitError(f"no read thread could start: {exc!r}", 0) from exc
                log.debug("only %d of %d read threads started", len(self._threads), self.n_threads, exc_info=True)
        put = self._queue.put
        for op in ops:
            put(op)
        self._in_flight += len(ops)

    def _start_threads(self) -> None:
        while len(self._threads) < self.n_threads:
            thread = threading.Thread(target=self._work, name=f"aioexperts-read-{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        """A worker thread: read ops until the ``None`` that :meth:`close` queues."""
        get, read = self._queue.get, self._read
        while (op := get()) is not None:
            read(op)

    def _read(self, op: ReadOp) -> None:
        result: ReadResult
        try:
            with self.slab.writable_view(op.slot, op.slot_offset, op.n_bytes) as view:
                result = os.preadv(self.files.fds[op.shard], [view], op.file_offset)
        except Exception as exc:  # every failure is the read's result, never lost in the pool
            result = exc
        with self._lock:
            self._done_ops.append(op)
            self._done_results.append(result)
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except Exception:  # the event loop is gone: nobody is left to tell
                log.debug("a read completed after its event loop closed", exc_info=True)

    def _drain(self) -> None:
        with self._lock:
            ops, results = self._done_ops, self._done_results
            self._done_ops, self._done_results = [], []
            self._wake_pending = False
        if ops:  # one call of the scheduler's batch sink for the lot, then the batch's end
            self._deliver_reaped(ops, results)
            self._end_batch()

    def close(self) -> None:
        if self._closed:
            return
        self._check_closable()
        self._closed = True
        for _ in self._threads:  # nothing is in flight: each worker takes one None and ends
            self._queue.put(None)
