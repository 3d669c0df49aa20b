"""The expert cache: ``(layer, expert)`` -> slot, with pin counts, in-flight sharing and eviction.

A slot's entry goes FREE -> LOADING -> READY (or back to FREE when its load fails or is dropped
before submission). The invariants (DESIGN.md):

1. A slot whose read is in flight is never handed to another expert, even when every waiter was
   cancelled: LOADING entries are never eviction candidates, and a slot returns to the free list
   only from a load's completion (or from a load dropped before it was submitted).
2. A pinned slot is never evicted. When a request cannot get enough slots because every slot is
   pinned, it fails with :class:`SlabExhaustedError` or, if it asked to, waits for a slot to be
   released (holding no pins while it waits, so waiting requests cannot deadlock among
   themselves; waiting requests are served first come, first served). Slots that are only
   loading (a prefetch, or a read whose waiters were cancelled) are always waited for. A task
   that already holds pins and then waits for more slots can deadlock against the requests queued
   before it: release first, or request all the experts at once.
3. A failed load fails every waiter of that expert with the same error, frees the slot, and
   leaves the cache usable.

All state changes are decided synchronously on the loop thread; awaiting happens afterwards.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from enum import Enum

from .._errors import AioExpertsError, EngineClosedError, SlabExhaustedError
from .._io.loop import AsyncEvent, LoopAdapter
from .._io.plan import ExpertPlan
from .eviction import EvictionPolicy
from .scheduler import Load, Priority, ReadScheduler
from .stats import Counters

__all__ = ("Entry", "ExpertCache", "Key", "SlotState")

log = logging.getLogger("aioexperts")

#: ``(layer, expert)``: block index and global expert id.
Key = tuple[int, int]


class SlotState(Enum):
    """State of a cache entry's slot."""

    FREE = 0
    LOADING = 1
    READY = 2


class Entry:
    """One expert in one slot.

    Attributes:
        key: ``(layer, expert)``.
        slot: slot index.
        plan: the expert's reads and payload offsets.
        state: LOADING or READY while in the cache; FREE once failed or dropped.
        pins: requests currently using the entry.
        error: why the load failed (state FREE), else None.
        prefetched: loaded by a prefetch and not requested since.
    """

    __slots__ = ("error", "event", "key", "load", "pins", "plan", "prefetched", "slot", "state")

    def __init__(self, key: Key, slot: int, plan: ExpertPlan, event: AsyncEvent) -> None:
        self.key = key
        self.slot = slot
        self.plan = plan
        self.state = SlotState.LOADING
        self.pins = 0
        self.error: AioExpertsError | None = None
        self.prefetched = False
        self.event = event
        self.load: Load | None = None

    def __repr__(self) -> str:
        return f"Entry({self.key}, slot={self.slot}, {self.state.name}, pins={self.pins})"


class ExpertCache:
    """Maps experts to slab slots and loads the missing ones through a :class:`ReadScheduler`.

    Args:
        n_slots: slots in the slab.
        plan_of: ``(layer, expert) -> ExpertPlan``; raises ``InvalidRequestError`` for a key
            the model does not have.
        scheduler: where loads go.
        policy: orders READY, unpinned entries for eviction.
        loop: event loop adapter.
        counters: statistics to update.
    """

    def __init__(
        self,
        n_slots: int,
        plan_of: Callable[[int, int], ExpertPlan],
        scheduler: ReadScheduler,
        policy: EvictionPolicy,
        loop: LoopAdapter,
        counters: Counters,
    ) -> None:
        self.n_slots = n_slots
        self.plan_of = plan_of
        self.scheduler = scheduler
        self.policy = policy
        self.loop = loop
        self.counters = counters
        self.entries: dict[Key, Entry] = {}
        self.free_slots: list[int] = list(range(n_slots - 1, -1, -1))
        self.closed = False
        self._turns: deque[AsyncEvent] = deque()  # requests waiting for slots, oldest first

    # -- queries ------------------------------------------------------------------------------

    def state_of(self, key: Key) -> SlotState:
        """FREE (not cached), LOADING or READY."""
        entry = self.entries.get(key)
        return SlotState.FREE if entry is None else entry.state

    @property
    def pinned_slots(self) -> int:
        """Entries with at least one pin."""
        return sum(1 for e in self.entries.values() if e.pins)

    # -- acquire / release ----------------------------------------------------------------------

    async def acquire(
        self, keys: Sequence[Key], *, wait: bool = False, after_pin: Callable[[], object] | None = None
    ) -> list[Entry]:
        """Pin every expert of ``keys`` (duplicates allowed) and wait until all are READY.

        ``after_pin`` runs right after the entries are pinned and their loads queued, before
        waiting: the place to start prefetches, which then cannot evict what this call needs.

        Returns:
            The pinned entries, one per unique key in first-seen order. Release them with
            :meth:`release` exactly once.

        Raises:
            InvalidRequestError: a key the model does not have (nothing was pinned).
            SlabExhaustedError: more unique keys than slots, or (``wait=False``) not enough
                slots that are free, evictable, or loading without a pin (those are waited for).
            ExpertReadError: a load failed; the same error for every waiter of that expert.
            EngineClosedError: the cache was closed (also while waiting).

        Cancellation handling:
            Cancelling the caller unpins its entries and re-raises the cancellation; loads it
            started keep running to completion and their slots stay LOADING until then.
        """
        self._check_open()
        unique = list(dict.fromkeys(keys))
        plans = {key: self.plan_of(*key) for key in unique if key not in self.entries}
        if len(unique) > self.n_slots:
            raise SlabExhaustedError(
                f"{len(unique)} experts requested at once but the slab has {self.n_slots} slots; open with more slots"
            )
        pinned = await self._pin_in_turn(unique, plans, wait)
        try:
            if after_pin is not None:
                after_pin()
            for entry in pinned:
                if entry.state is SlotState.LOADING:
                    await entry.event.wait()
        except BaseException:
            self.release(pinned)
            raise
        failed = next((e for e in pinned if e.error is not None), None)
        if failed is not None or self.closed:
            self.release(pinned)
            if failed is not None and failed.error is not None:
                raise failed.error
            raise EngineClosedError("the engine was closed while waiting for experts")
        return pinned

    async def _pin_in_turn(self, unique: list[Key], plans: dict[Key, ExpertPlan], wait: bool) -> list[Entry]:
        """Pin ``unique``; requests that must wait for slots are served first come, first served.

        A request that needs no new slot (every key cached) or that does not wait goes ahead;
        any other request queues behind the ones already waiting, so a large request is not
        starved by a stream of small ones.
        """
        ticket: AsyncEvent | None = None
        try:
            while True:
                needs_slots = any(key not in self.entries for key in unique)
                at_head = ticket is not None and self._turns[0] is ticket
                if not wait or not needs_slots or at_head or not self._turns:
                    pinned = self._pin_all(unique, plans)
                    if pinned is not None:
                        return pinned
                    if not wait and not self._unpinned_loads():
                        raise SlabExhaustedError(
                            f"no free slot for {len(unique)} experts: {self.pinned_slots} of {self.n_slots} slots "
                            "are pinned and the rest are loading; open with more slots or acquire with wait=True"
                        )
                new = self.loop.new_event()
                if ticket is None:
                    self._turns.append(new)
                else:
                    self._turns[self._turns.index(ticket)] = new
                ticket = new
                await ticket.wait()
                self._check_open()
        finally:
            if ticket is not None:
                head = self._turns[0] is ticket
                self._turns.remove(ticket)
                if head:
                    self._signal_space()  # the next in line may fit in what is left

    def _pin_all(self, keys: list[Key], plans: dict[Key, ExpertPlan]) -> list[Entry] | None:
        """Pin present entries and start loads for missing ones; None (and no change) if slots run out."""
        present: list[Entry] = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                entry.pins += 1
                present.append(entry)
        started: list[Entry] = []
        for key in keys:
            if key in self.entries:
                continue
            slot = self._take_slot(lambda k: True)
            if slot is None:
                for entry in started:
                    if not self._undo_start(entry):  # pragma: no cover - loads go out a tick later
                        entry.pins -= 1
                for entry in present:
                    entry.pins -= 1
                return None
            plan = plans.get(key) or self.plan_of(*key)
            entry = self._start(key, slot, plan, Priority.DEMAND)
            entry.pins = 1
            started.append(entry)
        c = self.counters
        c.requests += len(keys)
        c.misses += len(started)
        for entry in present:
            if entry.state is SlotState.READY:
                c.hits += 1
                self.policy.access(entry.key)
            else:
                c.inflight_joins += 1
                if entry.load is not None:
                    self.scheduler.promote(entry.load)
            if entry.prefetched:
                entry.prefetched = False
                c.prefetch_hits += 1
        return [self.entries[key] for key in keys]

    def release(self, entries: Sequence[Entry]) -> None:
        """Unpin entries from :meth:`acquire` (synchronous, safe in cleanup code)."""
        freed = False
        for entry in entries:
            if self.entries.get(entry.key) is entry and entry.pins > 0:
                entry.pins -= 1
                freed |= entry.pins == 0 and entry.state is SlotState.READY
        if freed:
            self._signal_space()

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, keys: Sequence[Key]) -> int:
        """Start loads for those of ``keys`` not cached, as far as free or evictable slots allow.

        Never waits and never raises for lack of space. A prefetch never evicts a pinned or
        loading entry, nor any entry of a layer it is prefetching for. Invalid keys raise
        ``InvalidRequestError`` before anything starts.

        Returns:
            The number of loads started.
        """
        self._check_open()
        missing = [k for k in dict.fromkeys(keys) if k not in self.entries]
        plans = [(k, self.plan_of(*k)) for k in missing]
        layers = {k[0] for k in missing}
        started = 0
        for key, plan in plans:
            slot = self._take_slot(lambda k: k[0] not in layers)
            if slot is None:
                break
            entry = self._start(key, slot, plan, Priority.PREFETCH)
            entry.prefetched = True
            started += 1
        self.counters.prefetch_issued += started
        return started

    def drop_prefetches(self, keep: Callable[[Key], bool] = lambda key: False) -> int:
        """Drop queued (not yet submitted) prefetch loads whose key ``keep`` rejects.

        Returns:
            The number dropped; their slots are free again.
        """
        dropped = 0
        for load in self.scheduler.queued_prefetches():
            key = (load.plan.location.layer, load.plan.location.expert)
            entry = self.entries.get(key)
            if entry is None or entry.load is not load or entry.pins or keep(key):
                continue
            if self._undo_start(entry):
                dropped += 1
        self.counters.prefetch_dropped += dropped
        if dropped:
            self._signal_space()
        return dropped

    # -- internals ------------------------------------------------------------------------------

    def _take_slot(self, may_evict: Callable[[Key], bool]) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()

        def can_evict(key: Key) -> bool:
            entry = self.entries[key]
            return entry.pins == 0 and entry.state is SlotState.READY and may_evict(key)

        victim = self.policy.victim(can_evict)
        if victim is None:
            return None
        entry = self.entries.pop(victim)
        self.policy.remove(victim)
        entry.state = SlotState.FREE
        self.counters.evictions += 1
        if entry.prefetched:
            self.counters.prefetch_wasted += 1
        return entry.slot

    def _start(self, key: Key, slot: int, plan: ExpertPlan, priority: Priority) -> Entry:
        entry = Entry(key, slot, plan, self.loop.new_event())
        entry.load = Load(plan, slot, priority, functools.partial(self._loaded, entry))
        self.entries[key] = entry
        self.scheduler.enqueue(entry.load)
        return entry

    def _undo_start(self, entry: Entry) -> bool:
        """Forget an entry whose load was never submitted; False (and no change) if it was."""
        assert entry.load is not None
        if not self.scheduler.drop(entry.load):
            return False
        del self.entries[entry.key]
        entry.state = SlotState.FREE
        entry.load = None
        self.free_slots.append(entry.slot)
        return True

    def _loaded(self, entry: Entry, load: Load) -> None:
        entry.load = None
        if load.error is not None:
            self.counters.read_errors += 1
            entry.error = load.error
            entry.state = SlotState.FREE
            if self.entries.get(entry.key) is entry:
                del self.entries[entry.key]
            self.free_slots.append(entry.slot)
            self._signal_space()
        else:
            entry.state = SlotState.READY
            self.counters.payload_bytes += entry.plan.location.n_bytes
            try:
                self.policy.admit(entry.key)
            except Exception:  # a faulty custom policy must not strand the waiters
                log.exception("aioexperts: the eviction policy failed to admit %s", entry.key)
            if entry.pins == 0:
                self._signal_space()
        entry.event.set()

    def _unpinned_loads(self) -> bool:
        """Some slot is LOADING with no pin: it becomes evictable when its read completes."""
        return any(e.state is SlotState.LOADING and e.pins == 0 for e in self.entries.values())

    def _signal_space(self) -> None:
        """Slots may have become free or evictable: let the first request in line try again."""
        if self._turns:
            self._turns[0].set()

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the engine is closed")

    def close(self) -> None:
        """Refuse new requests; drop queued loads; wake every waiter (they get ``EngineClosedError``).

        Loads already submitted keep their slots until they complete.
        """
        self.closed = True
        for entry in list(self.entries.values()):
            if entry.load is not None and self.scheduler.drop(entry.load):
                del self.entries[entry.key]
                entry.error = EngineClosedError("the engine was closed before this expert was read")
                entry.state = SlotState.FREE
                self.free_slots.append(entry.slot)
                entry.event.set()
        for turn in self._turns:  # every request waiting for slots gets EngineClosedError
            turn.set()
