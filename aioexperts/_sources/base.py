"""The expert-source interface: where an :class:`~aioexperts.ExpertStore` gets pinned experts from.

A source owns the resources of one way of serving experts (the slab mode's files, slab, backend,
scheduler and cache; the page-cache mode's mappings and warming) and answers the store's
requests. The store keeps what is common: argument checks, the lifecycle (start, the held
cancellation of ``aclose``, the release thread) and the public views. A new source (a remote
shard, a GPU arena) implements this class and nothing in the store changes.

The lifecycle a source goes through, driven by the store:

1. :meth:`ExpertSource.start` (on the loop; blocking parts through the ``build`` it is given, which
   keeps what it opened even when the start is cancelled, so that step 5 still releases it);
2. requests: :meth:`~ExpertSource.acquire` / :meth:`~ExpertSource.view` /
   :meth:`~ExpertSource.release`, :meth:`~ExpertSource.prefetch`,
   :meth:`~ExpertSource.drop_prefetches`, :meth:`~ExpertSource.rows`;
3. :meth:`~ExpertSource.close`: refuse new work, fail what is queued (synchronous);
4. :meth:`~ExpertSource.idle_waits` awaited (each through the store's held cancellation), then
   :meth:`~ExpertSource.detach` from the loop;
5. :meth:`~ExpertSource.release_parts` called in the store's release thread (ring exit, ``munmap``
   and ``close`` block), each part attempted even after another raised.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

import anyio

from .._cache.cache import Key
from .._cache.stats import StoreStatistics
from .._format.layout import ExpertLayout
from .._format.model import GGUFModel
from .._format.views import ExpertTable, ExpertView
from .._io.loop import LoopAdapter, wait_through_cancellation
from .._timeline import Timeline
from .rows import RowStatistics, RowsView

__all__ = ("Build", "ExpertSource", "HeldLayers", "Pinned", "build_and_keep", "finish_in_thread")

T = TypeVar("T")

#: What a source pins: an opaque handle per expert with its ``key``; only the same source reads it.
Pinned = Any


class Build(Protocol):
    """``build(owner, attribute, fn)``: run the blocking ``fn`` in a worker thread to its end and store
    its result as ``owner.<attribute>`` in that thread, so that a cancelled start still releases it."""

    def __call__(self, owner: object, attribute: str, build: Callable[[], T], /) -> Awaitable[T]: ...


class HeldLayers(ABC):
    """The resident experts of a source held in place without pins (:meth:`ExpertSource.hold_resident`).

    :meth:`view` may be called from any thread while the hold lasts; :meth:`end` on the event loop.
    """

    @abstractmethod
    def view(self, key: Key) -> ExpertView | None:
        """The views of ``key``'s expert if it is resident at full precision (valid until
        :meth:`end`), else None (not read yet, loading, or a low-tier copy)."""

    def table(self, keys: Sequence[Key]) -> ExpertTable | None:
        """The :class:`~aioexperts._format.views.ExpertTable` of the experts ``keys`` (every expert
        of one layer, expert by expert) when all are resident at full precision with one layout;
        else None (then :meth:`view` serves them one by one). None unless a source keeps tables."""
        return None

    @abstractmethod
    def end(self, requests: int) -> None:
        """End the hold; ``requests`` experts were served from it (counted as cached hits)."""


class ExpertSource(ABC):
    """One way of serving a model's experts to an :class:`~aioexperts.ExpertStore`.

    Attributes:
        kind: the store's ``mode`` this source serves (``"slab"``, ``"pagecache"``).
    """

    kind: str

    @abstractmethod
    async def start(self, model: GGUFModel, layout: ExpertLayout, loop: LoopAdapter, build: Build) -> None:
        """Open what the source needs; blocking work goes through ``build``.

        Raises:
            BackendUnavailableError, ConfigError, OSError: the set-up failed; what was opened is
                released by :meth:`release_parts`.
        """

    @property
    @abstractmethod
    def started(self) -> bool:
        """True once :meth:`start` has completed."""

    @property
    @abstractmethod
    def n_slots(self) -> int:
        """The most distinct experts that can be pinned at once."""

    @abstractmethod
    async def acquire(
        self,
        keys: Sequence[Key],
        *,
        wait: bool,
        after_pin: Callable[[], None],
        slot_timeout: float | None,
    ) -> Sequence[Pinned]:
        """Pin ``keys`` (unique, checked), loading what is missing; ``after_pin()`` once all are pinned.

        Raises:
            SlabExhaustedError, SlotTimeoutError, ExpertReadError, StoreClosedError: as
                :meth:`aioexperts.ExpertStore.experts`.
        """

    def pin_ready(self, keys: Sequence[Key]) -> Sequence[Pinned] | None:
        """Pin ``keys`` (unique, checked) at once if all are resident: a hit with nothing to await.

        Returns:
            What :meth:`acquire` would return, or None (nothing changed) when a key is not
            resident; the store then awaits :meth:`acquire`. The default always says None.

        Raises:
            EvictionPolicyError, StoreClosedError: as :meth:`acquire`.
        """
        return None

    @abstractmethod
    def view(self, pinned: Pinned) -> ExpertView:
        """Zero-copy views of one pinned expert's gate, up and down bytes."""

    def views(self, pinned: Sequence[Pinned]) -> list[ExpertView]:
        """:meth:`view` of each of ``pinned``, in order, in one call."""
        view = self.view
        return [view(p) for p in pinned]

    def end_views(self, pinned: Sequence[Pinned], views: Sequence[ExpertView]) -> None:
        """A request's block ends (before :meth:`release`): by default its views are released.

        ``views[i]`` is what :meth:`view` gave for ``pinned[i]``. A source whose views are
        shared between requests keeps them and only checks that nothing outlives the pin.

        Warns:
            ResourceWarning: a view's bytes are still exported (e.g. by ``np.frombuffer``).
        """
        for view in views:
            view.release()

    @abstractmethod
    def release(self, pinned: Sequence[Pinned], owner: object | None = None) -> None:
        """Unpin what :meth:`acquire` returned; ``owner``: the task that pinned them (default the
        current one: an ``experts()`` block's exit may run in another task)."""

    @abstractmethod
    def prefetch(self, keys: Sequence[Key], low: Sequence[Key] = ()) -> int:
        """Start loading ``keys`` without waiting (``low``: those to read from the miss tier, where
        the source has one); the number started."""

    def start_loads(
        self,
        demand: Sequence[Key],
        prefetch: Sequence[Key],
        low: Sequence[Key] = (),
        low_prefetch: Sequence[Key] = (),
        speculative: Sequence[Key] = (),
    ) -> int:
        """Start loading a request's ``demand`` keys ahead of its ``prefetch`` keys, submitted now
        (``low``, ``low_prefetch``: demand and prefetch keys to read from the miss tier, where the
        source has one), and ``speculative`` keys only while the device would otherwise be idle,
        where the source can tell; the number started. The default prefetches the first two, in
        that order, and ignores ``speculative``."""
        return self.prefetch([*demand, *prefetch])

    def read_backlog_seconds(self) -> float | None:
        """Seconds the reads queued and in flight would take at the device rate measured so far
        (None: no rate measured yet, or a source without a read queue)."""
        return None

    def record_timeline(self, timeline: Timeline | None) -> bool:
        """Record each expert load into ``timeline`` (None: stop); False for a source that reads
        nothing it could record (the default)."""
        return False

    @abstractmethod
    def drop_prefetches(self, keep: Callable[[Key], bool]) -> int:
        """Forget queued prefetches whose key ``keep`` rejects; the number dropped."""

    def is_ready(self, key: Key) -> bool:
        """Whether ``key``'s bytes are in memory now, so pinning it waits for no read (a hint:
        a source that cannot tell says False)."""
        return False

    def ready(self, keys: Sequence[Key]) -> list[bool]:
        """:meth:`is_ready` of each of ``keys`` (checked), in one call."""
        is_ready = self.is_ready
        return [is_ready(key) for key in keys]

    def layer_ready(self, layer: int, n_experts: int) -> bool:
        """Whether all ``n_experts`` experts of ``layer`` are in memory at full precision, so no
        prefetch of that layer can help (a hint: a source that cannot tell says False)."""
        return False

    def model_ready(self, n_experts: int) -> bool:
        """Whether all ``n_experts`` routed experts of the model are in memory at full precision
        (every :meth:`layer_ready`; a hint: a source that cannot tell says False)."""
        return False

    def hold_resident(self, n_experts: int) -> HeldLayers | None:
        """Hold the resident experts in place, without pins, when the source never needs to evict
        one (it has room for all ``n_experts`` of the model): until :meth:`HeldLayers.end` no
        resident expert leaves or changes its slot. None (nothing held) when it may evict, or for a
        source that cannot hold (the default)."""
        return None

    @abstractmethod
    def rows(self, tensor: str, row_ids: Sequence[object]) -> AbstractAsyncContextManager[RowsView]:
        """Pinned views of rows of a 2-D tensor (:meth:`aioexperts.ExpertStore.rows`)."""

    @abstractmethod
    def row_statistics(self) -> RowStatistics | None:
        """The row reads' counters, or None when there are none."""

    @abstractmethod
    def statistics(self) -> StoreStatistics:
        """A frozen snapshot of the counters and the I/O set-up."""

    @abstractmethod
    def reset_statistics(self) -> None:
        """Zero the counters."""

    @abstractmethod
    def close(self) -> None:
        """Refuse new work; fail what is queued and never submit it."""

    @abstractmethod
    def idle_waits(self) -> list[Callable[[], Awaitable[None]]]:
        """Waits, in order, until nothing is queued or in flight (after :meth:`close`)."""

    @abstractmethod
    def detach(self) -> None:
        """Stop listening on the event loop (after the idle waits)."""

    @abstractmethod
    def release_parts(self) -> list[Callable[[], None]]:
        """The blocking releases, in order (each idempotent); run in the store's release thread."""


async def finish_in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread, run to its end: what it builds is never lost to a cancellation.

    Cancellation handling:
        A cancellation that arrives while ``fn`` runs (a plain asyncio ``Task.cancel()`` or a
        ``wait_for`` timeout included: anyio does not shield those) is held until ``fn`` has
        returned, then raised; ``fn`` keeps what it opens on its owner, which releases it. A
        cancellation before the thread took ``fn`` means it never runs.
    """
    lock = threading.Lock()
    state = ["queued"]  # -> "running" in the worker, or -> "abandoned" here
    done = threading.Event()

    def call() -> T | None:
        with lock:
            if state[0] == "abandoned":
                return None
            state[0] = "running"
        try:
            return fn()
        finally:
            done.set()

    try:
        return await anyio.to_thread.run_sync(call)  # type: ignore[arg-type]  # None only when abandoned
    except anyio.get_cancelled_exc_class():
        with lock:
            if state[0] == "queued":
                state[0] = "abandoned"
                raise
        await wait_through_cancellation(lambda: anyio.to_thread.run_sync(done.wait), done.is_set)  # a second cancel too
        raise


async def build_and_keep(owner: object, attribute: str, build: Callable[[], T]) -> T:
    """The :data:`Build` every source is given: ``build()`` through :func:`finish_in_thread`, its
    result stored as ``owner.<attribute>`` in the worker thread."""

    def call() -> T:
        value = build()
        setattr(owner, attribute, value)
        return value

    return await finish_in_thread(call)
