"""One builder for a read stack: a slab of slots, a backend reading into it, a scheduler feeding it.

The expert slab (:mod:`.slab`) and the row slab (:mod:`.rows`) are the same machinery at two
grains; :class:`ReadStack` assembles it once for both. :meth:`ReadStack.build` does the blocking
part (mapping the slab, ring set-up, buffer registration) in a worker thread, keeping each piece
on the stack as soon as it exists so that a failed or cancelled build is still released by
:meth:`ReadStack.release_parts`; :meth:`ReadStack.start` attaches the backend to the loop and
makes the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .._cache.scheduler import ReadScheduler
from .._cache.stats import Counters
from .._io.backends.base import IOBackend
from .._io.files import ShardFiles
from .._io.loop import LoopAdapter
from .._io.select import BackendFactory, create_backend
from .._io.slab import Slab

__all__ = ("ReadStack",)


class ReadStack:
    """Slab + backend + scheduler over one model's open shard files.

    Attributes:
        slab: the slab (None until built).
        backend: the backend (None until built).
        fallback_reason: why the backend is not the one asked for (None when it is).
        scheduler: the read scheduler (None until started).
    """

    def __init__(self) -> None:
        self.slab: Slab | None = None
        self.backend: IOBackend | None = None
        self.fallback_reason: str | None = None
        self.scheduler: ReadScheduler | None = None

    def build_slab(self, n_slots: int, slot_bytes: int, *, hugepages: bool = False, lock: bool = False) -> Slab:
        """Map the slab (blocking: pre-faults the memory)."""
        self.slab = Slab(n_slots, slot_bytes, hugepages=hugepages, lock=lock)
        return self.slab

    def build_backend(
        self,
        backend: str | BackendFactory,
        files: ShardFiles,
        loop: LoopAdapter,
        queue_depth: int,
        options: dict[str, object],
        shapes: Iterable[tuple[int, int]] | None = None,
    ) -> IOBackend:
        """Set up the backend over the slab, not attached to the loop (blocking: ring set-up,
        buffer registration, the iovecs of ``shapes``: ``(slot offset, bytes)`` read at once)."""
        assert self.slab is not None, "build_slab first"
        built, self.fallback_reason = create_backend(
            backend,
            files,
            self.slab,
            loop,
            queue_depth,
            attach=False,
            **options,
        )
        self.backend = built
        if shapes is not None:
            built.prepare(shapes)
        return built

    def start(
        self, loop: LoopAdapter, counters: Counters, files: ShardFiles, max_bytes_in_flight: int, paths: tuple[str, ...]
    ) -> ReadScheduler:
        """On the loop: attach the backend and make the scheduler."""
        assert self.backend is not None, "build_backend first"
        self.backend.attach()
        self.scheduler = ReadScheduler(
            self.backend,
            loop,
            counters,
            files.sizes,
            files.dio_alignment,  # short reads continue at the kernel's alignment
            max_bytes_in_flight,
            paths,
        )
        return self.scheduler

    def detach(self) -> None:
        """Stop the backend listening on the loop."""
        if self.backend is not None:
            self.backend.detach()

    def release_parts(self) -> list[Callable[[], None]]:
        """Close the backend, then unmap the slab (each idempotent; blocking)."""
        parts: list[Callable[[], None]] = []
        if self.backend is not None:
            parts.append(self.backend.close)
        if self.slab is not None:
            parts.append(self.slab.close)
        return parts
