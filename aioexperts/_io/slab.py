"""The slab: one anonymous ``mmap`` cut into equal, page-aligned cache slots.

Every expert read lands in a slot; the executor and hosts read the slot memory in place through
read-only memoryviews. Reads target slot memory through :meth:`Slab.raw_buffer`, which wraps the
address without exporting the mmap's buffer, so the slab can always be unmapped once every read
has completed (the ``liburing`` ``Iovec`` never releases a buffer export it takes).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import resource
import weakref

import numpy as np

from .._errors import ConfigError
from .align import align_up

__all__ = ("Slab", "slot_stride")

log = logging.getLogger("aioexperts")

PAGE_SIZE = mmap.PAGESIZE
HUGE_PAGE_SIZE = 2 << 20
#: the smallest slab laid out for transparent huge pages (a smaller one would fault a whole 2 MiB page)
THP_MIN_BYTES = 2 * HUGE_PAGE_SIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11 has no name for it
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def slot_stride(slot_bytes: int, *, hugepages: bool = False) -> int:
    """Bytes one slot takes in a :class:`Slab`: ``slot_bytes`` rounded up to the page size (2 MiB
    with ``hugepages``). Size a byte budget in these, not in ``slot_bytes``."""
    return align_up(slot_bytes, HUGE_PAGE_SIZE if hugepages else PAGE_SIZE)


class Slab:
    """``n_slots`` slots of ``slot_bytes`` each in one anonymous private mapping.

    Args:
        n_slots: number of slots (>= 1).
        slot_bytes: bytes a slot must hold; rounded up to the page size (or to 2 MiB with
            ``hugepages``), so every slot starts page-aligned.
        hugepages: round each slot up to 2 MiB, so that no slot shares a huge page (see ``thp``).
        thp: back a slab of at least :data:`THP_MIN_BYTES` with transparent huge pages: its memory
            starts on a 2 MiB boundary (the mapping is made up to 2 MiB larger and the slab starts
            at its first boundary) and is advised ``MADV_HUGEPAGE`` before it is pre-faulted. The
            memory a read lands in is then physically contiguous in 2 MiB runs: a registered buffer
            over it is a few 2 MiB pieces for the kernel instead of one per 4 KiB page, and a read
            of a slot is a few DMA segments, not one per page, so the block layer neither walks
            nor splits hundreds of pages per read (issue 36: a fifth to a third less CPU per GiB
            read, and more GB/s, on a virtio disk: docs/architecture.md). Slots need no 2 MiB
            alignment for it. A kernel without THP (or with it ``never``, or out of huge pages)
            ignores the advice and the slab works as before.
        populate: pre-fault the memory with ``MADV_POPULATE_WRITE`` so that no page fault happens
            inside an ``io_uring_submit`` (7-9 ms for 64 cold reads otherwise).
        lock: ``mlock`` the slab so it is never swapped.

    Raises:
        ConfigError: a size below 1, the mapping failed (too large), or ``lock`` failed (the
            message gives ``RLIMIT_MEMLOCK``).
    """

    def __init__(
        self,
        n_slots: int,
        slot_bytes: int,
        *,
        hugepages: bool = False,
        populate: bool = True,
        lock: bool = False,
        thp: bool = True,
    ) -> None:
        if n_slots < 1 or slot_bytes < 1:
            raise ConfigError(f"a slab needs n_slots >= 1 and slot_bytes >= 1, got {n_slots} and {slot_bytes}")
        self.slot_bytes = slot_stride(slot_bytes, hugepages=hugepages)
        self.n_slots = n_slots
        self.n_bytes = self.n_slots * self.slot_bytes
        #: the slab is laid out for transparent huge pages (2 MiB-aligned start, advised)
        self.thp = ((thp and self.n_bytes >= THP_MIN_BYTES) or hugepages) and hasattr(mmap, "MADV_HUGEPAGE")
        # with THP: the slab's bytes rounded up to whole huge pages, plus room to move its start to a
        # boundary (at most a huge page less a page, wherever the kernel puts the mapping)
        mapped = align_up(self.n_bytes, HUGE_PAGE_SIZE) + HUGE_PAGE_SIZE - PAGE_SIZE if self.thp else self.n_bytes
        try:
            self._mm: mmap.mmap | None = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, OverflowError, ValueError) as exc:
            raise ConfigError(
                f"cannot map a slab of {n_slots} slots x {self.slot_bytes} bytes = {self.n_bytes} bytes: {exc}; "
                "use fewer slots"
            ) from exc
        anchor = ctypes.c_char.from_buffer(self._mm)
        start = ctypes.addressof(anchor)
        del anchor  # releases the export taken by from_buffer
        #: bytes of the mapping before the slab (0, or what puts the slab on a 2 MiB boundary)
        self._offset = align_up(start, HUGE_PAGE_SIZE) - start if self.thp else 0
        self.address = start + self._offset
        # views handed out and still alive (ctypes arrays are unhashable: keyed by a counter)
        self._exporters: weakref.WeakValueDictionary[int, ctypes.Array[ctypes.c_char]] = weakref.WeakValueDictionary()
        self._next_view = itertools.count()
        self._shared: np.ndarray | None = None  # read-only bytes of the whole slab (shared_views)
        #: views made by :meth:`shared_views` (a count for tests and statistics)
        self.shared_views_made = 0
        self.locked = False
        # the slab's pages (whole huge pages with THP: the last one is faulted whole anyway)
        used = align_up(self.n_bytes, HUGE_PAGE_SIZE) if self.thp else self.n_bytes
        if self.thp:
            self._madvise(mmap.MADV_HUGEPAGE, used)  # before the pre-fault, which then takes huge pages
        if populate:
            self._madvise(MADV_POPULATE_WRITE, used)
        if lock:
            self._lock()

    def _madvise(self, advice: int, n_bytes: int) -> None:
        """``madvise`` the ``n_bytes`` from the slab's start (the mapping's bytes before it are left alone)."""
        assert self._mm is not None
        try:
            self._mm.madvise(advice, self._offset, n_bytes)
        except OSError as exc:  # an older kernel: only a missed optimisation
            log.debug("madvise(%d) on the slab failed: %s", advice, exc)

    def _lock(self) -> None:
        if _libc.mlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.n_bytes)) != 0:
            err = ctypes.get_errno()
            soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            raise ConfigError(
                f"mlock of the {self.n_bytes}-byte slab failed (errno {err}); RLIMIT_MEMLOCK is {limit}: "
                "raise it (ulimit -l) or open without CacheOptions(lock_memory=True)"
            )
        self.locked = True

    def _check(self, slot: int, start: int, n_bytes: int) -> None:
        if self._mm is None:
            raise ValueError("the slab is closed")
        if not 0 <= slot < self.n_slots or start < 0 or n_bytes < 0 or start + n_bytes > self.slot_bytes:
            raise IndexError(f"slot {slot} [{start}, {start + n_bytes}) is outside the slab")

    def exporter(self, slot: int, start: int, n_bytes: int, held_refs: int = 0) -> ctypes.Array[ctypes.c_char]:
        """An object exporting ``n_bytes`` bytes at ``start`` in ``slot``, for :func:`exported_view`.

        Each exporter is its own object, so the release of a view made from it can tell whether
        anything derived from the view (a numpy array) outlives it
        (:meth:`aioexperts.ExpertView.release`). While an exporter or anything derived from its
        views lives, :meth:`close` leaves the mapping to the garbage collector.

        Args:
            held_refs: references the caller keeps to the exporter (a cache of exporters: 1).
        """
        self._check(slot, start, n_bytes)
        assert self._mm is not None
        exporter = (ctypes.c_char * n_bytes).from_address(self.address + slot * self.slot_bytes + start)
        exporter.mapping = self._mm  # type: ignore[attr-defined]  # the mmap lives as long as any view
        exporter.held_refs = held_refs  # type: ignore[attr-defined]
        exporter.live_views = 0  # type: ignore[attr-defined]
        self._exporters[next(self._next_view)] = exporter
        return exporter

    def shared_views(self, slot: int, spans: tuple[tuple[int, int], ...]) -> list[memoryview]:
        """Read-only ``memoryview`` objects (format ``B``), one per ``(start, n_bytes)`` of ``spans``
        in ``slot``, each with a managed buffer of its own, cut from one read-only array over the
        whole slab.

        Cheaper than :meth:`view` (no exporter object per view: about 0.5 us instead of 3.5): the
        exporting object is shared by every such view, so whether an array made from one view
        outlives it is told by the view's managed buffer (its one referent), not by the exporter's
        reference count. While any such view (or anything derived from it) lives, :meth:`close`
        leaves the mapping to the garbage collector.

        Raises:
            IndexError: a span outside the slot (nothing is made).
            ValueError: the slab is closed.
        """
        shared = self._shared
        if shared is None:
            shared = self._shared_bytes()
        stride = self.slot_bytes
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} is outside the slab of {self.n_slots} slots")
        base = slot * stride
        views = []
        for start, n_bytes in spans:
            if start < 0 or n_bytes < 0 or start + n_bytes > stride:
                raise IndexError(f"slot {slot} [{start}, {start + n_bytes}) is outside the slab")
            begin = base + start
            views.append(memoryview(shared)[begin : begin + n_bytes])  # type: ignore[arg-type]
        self.shared_views_made += len(views)
        return views

    def projection_views(self, slot: int, spans: tuple[int, int, int, int, int, int]) -> tuple[memoryview, ...]:
        """The three views of :meth:`shared_views` for ``spans = (start0, end0, start1, end1, start2,
        end2)`` (slot offsets in bytes, ``start <= end``) in ``slot``: one expert's gate, up and down.

        The same views as ``shared_views(slot, ((start0, end0 - start0), ...))``, without its
        generic loop (made once per slot load on the loop thread: 1.5 us less per expert).

        Raises:
            IndexError: ``slot`` or a span outside the slab (nothing is made).
            ValueError: the slab is closed.
        """
        shared = self._shared
        if shared is None:
            shared = self._shared_bytes()
        g0, g1, u0, u1, d0, d1 = spans
        stride = self.slot_bytes
        if not (
            0 <= slot < self.n_slots and 0 <= g0 <= g1 <= stride and 0 <= u0 <= u1 <= stride and 0 <= d0 <= d1 <= stride
        ):
            raise IndexError(f"slot {slot} spans {spans} are outside the slab")
        base = slot * stride
        self.shared_views_made += 3
        return (
            memoryview(shared)[base + g0 : base + g1],  # type: ignore[arg-type]
            memoryview(shared)[base + u0 : base + u1],  # type: ignore[arg-type]
            memoryview(shared)[base + d0 : base + d1],  # type: ignore[arg-type]
        )

    def shared_bytes(self) -> np.ndarray:
        """A read-only uint8 array over the whole slab: while it (or anything made from it) lives,
        :meth:`close` leaves the mapping to the garbage collector. For raw addresses into the slab
        used outside any view (a table of slot addresses keeps it).

        Raises:
            ValueError: the slab is closed.
        """
        shared = self._shared
        return self._shared_bytes() if shared is None else shared

    def _shared_bytes(self) -> np.ndarray:
        if self._mm is None:
            raise ValueError("the slab is closed")
        exporter = (ctypes.c_char * self.n_bytes).from_address(self.address)
        exporter.mapping = self._mm  # type: ignore[attr-defined]  # the mmap lives as long as any view
        self._exporters[next(self._next_view)] = exporter
        shared: np.ndarray = np.frombuffer(exporter, dtype=np.uint8)  # type: ignore[call-overload]
        shared.flags.writeable = False
        self._shared = shared
        return shared

    def view(self, slot: int, start: int, n_bytes: int) -> memoryview:
        """A read-only ``memoryview`` (format ``B``) of ``n_bytes`` bytes at ``start`` in ``slot``,
        with an exporter of its own (:meth:`exporter`)."""
        return exported_view(self.exporter(slot, start, n_bytes))

    def writable_view(self, slot: int, start: int, n_bytes: int) -> memoryview:
        """A writable view for ``os.preadv`` (released by the caller when the read is done)."""
        self._check(slot, start, n_bytes)
        assert self._mm is not None
        base = self._offset + slot * self.slot_bytes + start
        return memoryview(self._mm)[base : base + n_bytes]

    def raw_buffer(self, slot: int, start: int, n_bytes: int) -> memoryview:
        """A writable memoryview of slot memory that holds no export of the mapping.

        For ``liburing.Iovec``, which keeps raw pointers and never releases what it takes. The
        caller must not use it after :meth:`close`.
        """
        self._check(slot, start, n_bytes)
        return self.raw_span(slot * self.slot_bytes + start, n_bytes)

    def raw_span(self, offset: int, n_bytes: int) -> memoryview:
        """Like :meth:`raw_buffer` for any range of the slab (``offset`` bytes from its start)."""
        if self._mm is None:
            raise ValueError("the slab is closed")
        if offset < 0 or n_bytes < 1 or offset + n_bytes > self.n_bytes:
            raise IndexError(f"[{offset}, {offset + n_bytes}) is outside the {self.n_bytes}-byte slab")
        array = (ctypes.c_char * n_bytes).from_address(self.address + offset)
        return memoryview(array).cast("B")

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._mm is None

    def close(self) -> None:
        """Unmap the slab; idempotent.

        Call only after every read into it has completed. If a host still holds a view from
        :meth:`view`, the memory stays mapped until that view is released.
        """
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        self._shared = None  # its exporter lives on only through views still held
        if self.locked:
            _libc.munlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.n_bytes))
        if len(self._exporters):
            log.debug("slab views are still held by the host; the mapping is freed when they are released")
            return
        try:
            mm.close()
        except BufferError:
            log.debug("slab views are still held by the host; the mapping is freed when they are released")

    def __repr__(self) -> str:
        return f"Slab(n_slots={self.n_slots}, slot_bytes={self.slot_bytes}, closed={self.closed})"


def exported_view(exporter: ctypes.Array[ctypes.c_char]) -> memoryview:
    """A fresh read-only ``memoryview`` (format ``B``) of an exporter's bytes (counted in its ``live_views``)."""
    exporter.live_views += 1  # type: ignore[attr-defined]
    return memoryview(exporter).cast("B").toreadonly()
