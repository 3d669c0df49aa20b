"""A bounded thread pool of ``os.preadv`` calls: the fallback where io_uring is not available."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
    the last one), so the loop pays one ``call_soon_threadsafe`` per batch, not per read. Whatever
    a read raises (``OSError``, ``ValueError`` from a closed slab, ``MemoryError``) is its result.

    Args:
        n_threads: worker threads (default: ``min(depth, 8)``); reads queue beyond that.
    """

    name = "threads"

    def __init__(
        self, files: ShardFiles, slab: Slab, loop: LoopAdapter, depth: int, n_threads: int | None = None
    ) -> None:
        super().__init__(files, slab, loop, depth)
        self.n_threads = n_threads or min(depth, 8)
        self._pool = ThreadPoolExecutor(self.n_threads, thread_name_prefix="aioexperts-read")
        self._lock = threading.Lock()
        self._done: list[tuple[ReadOp, ReadResult]] = []
        self._wake_pending = False
        self._closed = False

    def features(self) -> dict[str, Any]:
        return {"threads": self.n_threads}

    def submit(self, ops: Sequence[ReadOp]) -> None:
        if self._closed:
            raise SubmitError("submit on a closed thread backend", 0)
        pool, read = self._pool, self._read
        for i, op in enumerate(ops):
            try:
                pool.submit(read, op)
            except Exception as exc:  # RuntimeError after shutdown, or no thread could start
                raise SubmitError(f"the thread pool took {i} of {len(ops)} reads: {exc!r}", i) from exc
            self._in_flight += 1

    def _read(self, op: ReadOp) -> None:
        result: ReadResult
        try:
            with self.slab.writable_view(op.slot, op.slot_offset, op.n_bytes) as view:
                result = os.preadv(self.files.fds[op.shard], [view], op.file_offset)
        except Exception as exc:  # every failure is the read's result, never lost in the pool
            result = exc
        with self._lock:
            self._done.append((op, result))
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except Exception:  # the event loop is gone: nobody is left to tell
                log.debug("a read completed after its event loop closed", exc_info=True)

    def _drain(self) -> None:
        with self._lock:
            done, self._done = self._done, []
            self._wake_pending = False
        for op, result in done:
            self._deliver(op, result)

    def close(self) -> None:
        if self._closed:
            return
        self._check_closable()
        self._closed = True
        self._pool.shutdown(wait=False)
