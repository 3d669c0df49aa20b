"""The interface every read backend implements."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..files import ShardFiles
from ..loop import LoopAdapter
from ..slab import Slab

__all__ = ("CompletionSink", "IOBackend", "ReadOp")

log = logging.getLogger("aioexperts")


class ReadOp:
    """One read of ``n_bytes`` at ``file_offset`` of shard ``shard`` into ``slot`` at ``slot_offset``.

    With direct I/O, ``file_offset``, ``n_bytes`` and ``slot_offset`` are multiples of the
    alignment. ``context`` belongs to whoever submitted the op.
    """

    __slots__ = ("context", "file_offset", "n_bytes", "shard", "slot", "slot_offset", "submitted_ns")

    def __init__(
        self, shard: int, file_offset: int, n_bytes: int, slot: int, slot_offset: int, context: Any = None
    ) -> None:
        self.shard = shard
        self.file_offset = file_offset
        self.n_bytes = n_bytes
        self.slot = slot
        self.slot_offset = slot_offset
        self.context = context
        self.submitted_ns = 0

    def __repr__(self) -> str:
        return (
            f"ReadOp(shard={self.shard}, file_offset={self.file_offset}, n_bytes={self.n_bytes}, "
            f"slot={self.slot}, slot_offset={self.slot_offset})"
        )


#: Called on the loop thread once per op with the bytes read (``0 <= n <= n_bytes``) or the error.
CompletionSink = Callable[[ReadOp, "int | OSError"], None]


class IOBackend(ABC):
    """Reads into slab slots and reports each completion to a sink on the loop thread.

    The caller (the scheduler) bounds the ops in flight to ``depth``, submits from the loop
    thread only, and calls :meth:`close` only once :attr:`in_flight` is 0.
    """

    #: short name reported in statistics: ``io_uring``, ``threads``, ``fake``.
    name: ClassVar[str]

    def __init__(self, files: ShardFiles, slab: Slab, loop: LoopAdapter, depth: int) -> None:
        self.files = files
        self.slab = slab
        self.loop = loop
        self.depth = depth
        self._sink: CompletionSink | None = None
        self._in_flight = 0

    def set_sink(self, sink: CompletionSink) -> None:
        """Where completions go; set once before the first :meth:`submit`."""
        self._sink = sink

    @property
    def in_flight(self) -> int:
        """Ops submitted whose completion has not been delivered yet."""
        return self._in_flight

    @property
    def direct_io(self) -> bool:
        """True when reads bypass the page cache (``O_DIRECT``)."""
        return self.files.direct_io

    def features(self) -> dict[str, Any]:
        """Backend details for statistics (e.g. registered buffers)."""
        return {}

    @abstractmethod
    def submit(self, ops: Sequence[ReadOp]) -> None:
        """Start every op in ``ops`` as one submission (loop thread only)."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend's resources; only when nothing is in flight. Idempotent."""

    def _deliver(self, op: ReadOp, result: int | OSError) -> None:
        self._in_flight -= 1
        assert self._sink is not None
        try:
            self._sink(op, result)
        except Exception:  # one faulty completion must not lose the others of its batch
            log.exception("aioexperts: handling the completion of %r failed", op)
