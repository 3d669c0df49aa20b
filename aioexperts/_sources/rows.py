"""Row reads: a few rows of a huge 2-D tensor per call, through a small row cache of its own.

:class:`RowReader` is the expert store's machinery again at a smaller grain: windows of rows
(:mod:`aioexperts._io.rowplan`) are loaded by their own read scheduler, backend and slab into an
LRU cache of windows, so rows that share a window are read once and every read of one call goes
out in one submission. It is built on the first :meth:`aioexperts.ExpertStore.rows` call, with the same read-stack
builder as the expert slab (:class:`~aioexperts._sources.stack.ReadStack`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from .._cache.cache import Entry, ExpertCache
from .._cache.eviction import LRU
from .._cache.stats import Counters
from .._errors import ConfigError, InvalidRequestError, SlabExhaustedError
from .._format.dequant import dequantize
from .._format.model import GGUFModel
from .._format.views import release_view
from .._io.files import ShardFiles
from .._io.loop import LoopAdapter
from .._io.rowplan import RowTable, RowWindowPlan
from .._io.slab import slot_stride
from .._options import IOOptions
from .stack import ReadStack

__all__ = ("RowReader", "RowStatistics", "RowsView")


@dataclass(frozen=True, slots=True)
class RowsView:
    """Rows of one 2-D tensor, pinned (:meth:`aioexperts.ExpertStore.rows`).

    Attributes:
        tensor: the tensor's name.
        ggml_type: the type of the row bytes.
        n_cols: values per row.
        row_bytes: bytes per row.
        row_ids: the rows asked for, in the order asked (duplicates allowed).
        data: per row id, a read-only ``memoryview`` of the row's ``row_bytes`` raw bytes, equal to a
            plain ``pread`` of the file; valid inside the ``async with`` block.
    """

    tensor: str
    ggml_type: GGMLQuantizationType
    n_cols: int
    row_bytes: int
    row_ids: tuple[int, ...]
    data: tuple[memoryview, ...]

    def dequantize(self) -> np.ndarray:
        """The rows as float32 ``(n_rows, n_cols)`` (a copy; bit-exact with ``gguf.quants.dequantize``).

        CPU work: call it from a worker thread under an event loop (or use
        :meth:`aioexperts.ExpertStore.read_rows`).
        """
        raw = np.frombuffer(b"".join(self.data), dtype=np.uint8)
        return dequantize(raw, self.ggml_type, (len(self.row_ids), self.n_cols))

    def copy_bytes(self) -> np.ndarray:
        """The raw rows as uint8 ``(n_rows, row_bytes)`` (a copy)."""
        return np.frombuffer(b"".join(self.data), dtype=np.uint8).reshape(len(self.row_ids), self.row_bytes)


@dataclass(frozen=True, slots=True)
class RowStatistics:
    """What the row reads did (:meth:`aioexperts.ExpertStore.row_statistics`).

    Attributes:
        calls: ``rows()`` / ``read_rows()`` calls.
        rows: rows asked for (duplicates counted).
        windows: windows those rows fall in, once per call.
        window_hits, window_misses: windows found cached / read.
        bytes_read: bytes the reads returned (alignment padding included).
        useful_bytes: bytes of the distinct rows asked for.
        n_slots, slot_bytes: the row cache's geometry.
    """

    calls: int
    rows: int
    windows: int
    window_hits: int
    window_misses: int
    bytes_read: int
    useful_bytes: int
    n_slots: int
    slot_bytes: int

    @property
    def bytes_read_per_useful_byte(self) -> float:
        """``bytes_read / useful_bytes`` (NaN before any read)."""
        return self.bytes_read / self.useful_bytes if self.useful_bytes else float("nan")


class RowReader:
    """The row cache of one store: windows of rows in a slab of their own, an LRU over them.

    Built in a worker thread (mapping the row slab and setting up its backend block), then
    :meth:`start` on the loop.

    Args:
        model: the parsed model.
        files: the store's open shard files.
        loop: the event loop adapter.
        io: the store's read options (backend, queue depth, bytes in flight).
        cache_bytes: the row slab's size in bytes (at least 16 windows).

    Raises:
        ConfigError: the row slab cannot be mapped.
    """

    def __init__(self, model: GGUFModel, files: ShardFiles, loop: LoopAdapter, io: IOOptions, cache_bytes: int) -> None:
        self.model = model
        self.files = files
        self.loop = loop
        self.io = io
        self._tables: dict[str, RowTable] = {}
        self._by_index: list[RowTable] = []
        two_d = [t for t in model.tensors.values() if len(t.shape) == 2]
        alignment = files.alignment
        self.slot_bytes = max(
            (RowTable.of(0, t, alignment, files.sizes[t.shard]).slot_bytes for t in two_d), default=2 * alignment
        )
        # the budget counts what each slot maps (rounded up to a page), not the window's bytes
        self.n_slots = max(16, cache_bytes // slot_stride(self.slot_bytes))
        self.counters = Counters()
        self.calls = self.rows = self.windows = self.useful_bytes = 0
        self.stack = ReadStack()
        try:
            self.slab = self.stack.build_slab(self.n_slots, self.slot_bytes)
        except ConfigError as exc:
            raise ConfigError(
                f"the row cache of {cache_bytes} bytes cannot be mapped ({exc}); lower CacheOptions.row_cache_bytes"
            ) from exc
        self.stack.build_backend(io.backend, files, loop, io.queue_depth, io.backend_options())
        self.cache: ExpertCache

    def start(self) -> None:
        """On the loop: attach the backend, make the scheduler and the LRU cache of windows."""
        scheduler = self.stack.start(
            self.loop, self.counters, self.files, self.io.max_bytes_in_flight, tuple(s.path for s in self.model.shards)
        )
        self.cache = ExpertCache(self.n_slots, self._plan, scheduler, LRU(), self.loop, self.counters)

    def _plan(self, table: int, window: int) -> RowWindowPlan:
        return self._by_index[table].plan(window)

    def table(self, name: str) -> RowTable:
        """The row geometry of tensor ``name``.

        Raises:
            InvalidRequestError: no such tensor, or it is not 2-D.
        """
        found = self._tables.get(name)
        if found is None:
            tensor = self.model.tensors.get(name) if isinstance(name, str) else None
            if tensor is None:
                raise InvalidRequestError(f"the model has no tensor {name!r}")
            found = RowTable.of(len(self._by_index), tensor, self.files.alignment, self.files.sizes[tensor.shard])
            self._tables[name] = found
            self._by_index.append(found)
        return found

    @staticmethod
    def check_rows(table: RowTable, row_ids: Sequence[object]) -> list[int]:
        """``row_ids`` as ints in ``0..n_rows-1``, or InvalidRequestError."""
        rows = []
        for r in row_ids:
            if isinstance(r, bool) or not isinstance(r, int | np.integer):
                raise InvalidRequestError(f"row ids must be ints, got {r!r}")
            if not 0 <= int(r) < table.n_rows:
                raise InvalidRequestError(
                    f"{table.tensor.name} has rows 0..{table.n_rows - 1}; row {int(r)} does not exist"
                )
            rows.append(int(r))
        return rows

    async def acquire(self, table: RowTable, rows: list[int]) -> tuple[list[Entry], RowsView]:
        """Pin the windows of ``rows`` (loading the missing ones in one submission) and view the rows.

        Raises:
            SlabExhaustedError: the rows span more windows than the row cache has slots.
            ExpertReadError, StoreClosedError: as the expert cache.
        """
        windows = list(dict.fromkeys(table.window_of(r) for r in rows))
        if len(windows) > self.n_slots:
            raise SlabExhaustedError(
                f"{len(rows)} rows of {table.tensor.name} span {len(windows)} windows; the row cache has "
                f"{self.n_slots} (raise CacheOptions.row_cache_bytes, or ask for fewer rows at once)"
            )
        entries = await self.cache.acquire([(table.index, w) for w in windows], wait=True)
        by_window = {e.key[1]: e for e in entries}
        views = []
        for r in rows:
            entry = by_window[table.window_of(r)]
            plan = entry.plan
            assert isinstance(plan, RowWindowPlan)
            views.append(self.slab.view(entry.slot, table.row_offset(r) - plan.file_offset, table.row_bytes))
        self.calls += 1
        self.rows += len(rows)
        self.windows += len(windows)
        self.useful_bytes += len(set(rows)) * table.row_bytes
        qtype = GGMLQuantizationType(table.tensor.ggml_type)
        view = RowsView(
            table.tensor.name, qtype, int(table.tensor.shape[1]), table.row_bytes, tuple(rows), tuple(views)
        )
        return entries, view

    def release(self, entries: list[Entry], view: RowsView) -> list[int]:
        """Unpin; returns the row ids whose bytes are still exported (e.g. by ``np.frombuffer``)."""
        exported = [r for r, data in zip(view.row_ids, view.data, strict=True) if release_view(data)]
        self.cache.release(entries)
        return exported

    def statistics(self) -> RowStatistics:
        """A frozen snapshot."""
        c = self.counters
        return RowStatistics(
            self.calls,
            self.rows,
            self.windows,
            c.hits + c.inflight_joins,
            c.misses,
            c.bytes_read,
            self.useful_bytes,
            self.n_slots,
            self.slab.slot_bytes,
        )
