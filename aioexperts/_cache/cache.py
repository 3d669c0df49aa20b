"""The expert cache: ``(layer, expert)`` -> slot, with pin counts, in-flight sharing and eviction.

A slot's entry goes FREE -> LOADING -> READY (or back to FREE when its load fails or is dropped
before submission). The invariants (docs/notes/DESIGN.md):

1. A slot whose read is in flight is never handed to another expert, even when every waiter was
   cancelled: LOADING entries are never eviction candidates, and a slot returns to the free list
   only from a load's completion (or from a load dropped before it was submitted).
2. A pinned slot is never evicted. When a request cannot get enough slots because every slot is
   pinned, it fails with :class:`SlabExhaustedError` or, if it asked to, waits for a slot to be
   released (holding no pins while it waits, so waiting requests cannot deadlock among
   themselves; waiting requests are served first come, first served). Slots that are only
   loading (a prefetch, or a read whose waiters were cancelled) are always waited for; a request
   that does not wait waits only for those, never behind the queue of waiting requests. A task
   that already holds pins and then waits for more slots can deadlock against the requests queued
   before it: release first, or request all the experts at once.
3. A failed load fails every waiter of that expert with the same error, frees the slot, and
   leaves the cache usable.
4. A faulty eviction policy (any hook raising) costs the request an :class:`EvictionPolicyError`,
   never a pin or a slot: a request first *decides* (the policy's ``victim`` and ``access`` calls),
   then *mutates* (evictions, whose ``remove`` calls come after the cache has changed, then pins
   and loads).

All state changes are decided synchronously on the loop thread; awaiting happens afterwards.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections import deque
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from enum import Enum
from itertools import repeat
from typing import Protocol

import anyio

from .._errors import (
    AioExpertsError,
    ConfigError,
    EvictionPolicyError,
    ExpertReadError,
    SlabExhaustedError,
    SlotTimeoutError,
    StoreClosedError,
)
from .._io.loop import AsyncEvent, LoopAdapter
from .._io.plan import LoadPlan
from .eviction import EvictionPolicy
from .scheduler import Load, LoadState, Priority, ReadScheduler
from .stats import Counters

__all__ = ("Entry", "ExpertCache", "Key", "SlotState", "SlotViews")

log = logging.getLogger("aioexperts")

#: ``(layer, expert)``: block index and global expert id.
Key = tuple[int, int]


class SlotState(Enum):
    """State of a cache entry's slot."""

    FREE = 0
    LOADING = 1
    READY = 2


class SlotViews(Protocol):
    """What a source builds once per slot load for the requests that pin it (its views of the slot).

    The cache keeps it on the entry and calls :meth:`invalidate` when the slot leaves the entry
    (eviction, the store's release), so that no view of a slot outlives the expert it showed.
    """

    def invalidate(self) -> None: ...


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
        demanded: loaded by :meth:`ExpertCache.start_loads` for a request that has not pinned it yet
            (that request counts it as its miss).
        views: what the source built on the first view of this load (reused by every hit until the
            slot is reused), else None.
        waiters: the requests waiting for this load to finish (:class:`_Waiter`), else None.
        low: the slot holds the expert's low-precision miss-tier copy (``plan`` reads the sidecar).
        upgrade: a request hit the low copy: read it at full precision once nobody pins it.
        retired: a low copy replaced by its full copy while pinned: out of the cache, its slot
            freed by its last release.
    """

    __slots__ = (
        "demanded",
        "error",
        "key",
        "load",
        "low",
        "pins",
        "plan",
        "prefetched",
        "retired",
        "slot",
        "state",
        "upgrade",
        "views",
        "waiters",
    )

    def __init__(
        self,
        key: Key,
        slot: int,
        plan: LoadPlan,
        pins: int = 0,
        low: bool = False,
        demanded: bool = False,
        prefetched: bool = False,
    ) -> None:
        self.key = key
        self.slot = slot
        self.plan = plan
        self.state = SlotState.LOADING
        self.pins = pins
        self.error: AioExpertsError | None = None
        self.prefetched = prefetched
        self.demanded = demanded
        self.waiters: list[_Waiter] | None = None  # made by the first request that waits for the load
        self.load: Load | None = None
        self.views: SlotViews | None = None  # the source's views of this load, built on first view
        self.low = low
        self.upgrade = False
        self.retired = False

    def drop_views(self) -> None:
        """Invalidate and forget the source's views of this load (the slot goes to another expert)."""
        views, self.views = self.views, None
        if views is not None:
            views.invalidate()

    def __repr__(self) -> str:
        return f"Entry({self.key}, slot={self.slot}, {self.state.name}, pins={self.pins})"


class _Waiter:
    """One request waiting for some loads to finish: one event for all of them, not one per entry."""

    __slots__ = ("entries", "event", "left")

    def __init__(self, event: AsyncEvent) -> None:
        self.event = event
        self.left = 0  # loads not finished yet
        self.entries: list[Entry] = []  # the entries it waits for (for the backend's wake hint)


#: a plan table with no plan in it (a cache given none asks plan_of)
_NO_PLANS: dict[Key, LoadPlan] = {}

#: id(policy) -> the policy, for every policy serving an open cache (one policy, one cache).
_POLICY_OWNERS: weakref.WeakValueDictionary[int, EvictionPolicy] = weakref.WeakValueDictionary()


def _claim(policy: EvictionPolicy) -> None:
    """Refuse a policy instance another open cache already uses (its order would mix both caches' keys)."""
    if _POLICY_OWNERS.get(id(policy)) is policy:
        raise ConfigError(
            f"this {type(policy).__name__} instance already serves another open store: a policy keeps one "
            "store's order, give each store its own instance (or a policy name)"
        )
    try:
        _POLICY_OWNERS[id(policy)] = policy
    except TypeError:  # a policy without weak-reference support: not tracked
        pass
    policy.clear()  # a new cache starts empty: keys of an earlier (closed) store must not linger


class ExpertCache:
    """Maps experts to slab slots and loads the missing ones through a :class:`ReadScheduler`.

    Args:
        n_slots: slots in the slab.
        plan_of: ``(layer, expert) -> LoadPlan``; raises ``InvalidRequestError`` for a key
            the model does not have.
        scheduler: where loads go; :meth:`close` closes it.
        policy: orders READY, unpinned entries for eviction.
        loop: event loop adapter.
        counters: statistics to update.
        low_plan_of: ``(layer, expert) -> LoadPlan`` of the expert's low-tier copy (the miss tier),
            or None for an expert without one (read at full precision),
            else None.
        upgrade_low: read a low-tier copy that is hit again at full precision once nobody pins it.
        reads_behind: whether the reads are behind now (the miss tier's rule); while it says so,
            upgrades wait (they are tried again at each later release). None: never behind.
        plan_table: ``{(layer, expert): plan}`` of every key ``plan_of`` answers for without raising
            (the same plans), looked up directly on the miss path; ``plan_of`` still answers (and
            raises) for a key not in it. None: ``plan_of`` alone.
    """

    def __init__(
        self,
        n_slots: int,
        plan_of: Callable[[int, int], LoadPlan],
        scheduler: ReadScheduler,
        policy: EvictionPolicy,
        loop: LoopAdapter,
        counters: Counters,
        low_plan_of: Callable[[int, int], LoadPlan | None] | None = None,
        upgrade_low: bool = True,
        reads_behind: Callable[[], bool] | None = None,
        plan_table: Mapping[Key, LoadPlan] | None = None,
    ) -> None:
        self.n_slots = n_slots
        self.plan_of = plan_of
        # a key's plan in one dict lookup (no call, no new tuple), None when plan_of must answer
        self._plan_get: Callable[[Key], LoadPlan | None] = (_NO_PLANS if plan_table is None else plan_table).get
        self.low_plan_of = low_plan_of
        self.upgrade_low = upgrade_low
        self.reads_behind = reads_behind
        self._deferred: dict[Key, Entry] = {}  # low copies hit again whose upgrade waits for the reads
        # full copies being read for low copies that stay in the cache (and serve) until these land:
        # key -> the full copy's entry, not in ``entries`` yet, its own slot
        self._upgrading: dict[Key, Entry] = {}
        self.scheduler = scheduler
        _claim(policy)
        self.policy = policy
        self.loop = loop
        self.counters = counters
        self.entries: dict[Key, Entry] = {}
        self.free_slots: list[int] = list(range(n_slots - 1, -1, -1))
        self.closed = False
        self._turns: deque[AsyncEvent] = deque()  # requests waiting for slots, oldest first
        self._held: dict[object, int] = {}  # task -> experts it holds pinned
        # READY keys whose place in the policy is unknown (a hook raised on them): the cache
        # evicts them itself, before asking the policy, so their slots are never lost
        self._untracked: set[Key] = set()
        # keys that left the cache but whose policy.remove raised: removed again before an admit
        self._stale: set[Key] = set()
        self._full_ready: dict[int, int] = {}  # layer -> READY entries at full precision
        self._full_ready_total = 0  # the sum of _full_ready's values
        # layer -> bumped whenever an entry of the layer becomes READY or leaves its slot: an equal
        # count, the layer's entries where they were (placements())
        self._placements: dict[int, int] = {}
        self._holds = 0  # hold() calls not yet ended: no entry may leave or change its slot
        self._retired: set[Entry] = set()  # low copies replaced while pinned: their slots wait for the release
        self._waiting: set[_Waiter] = set()  # requests waiting for loads to finish
        scheduler.waiting_need = self._completions_needed

    # -- queries ------------------------------------------------------------------------------

    def state_of(self, key: Key) -> SlotState:
        """FREE (not cached), LOADING or READY."""
        entry = self.entries.get(key)
        return SlotState.FREE if entry is None else entry.state

    def ready(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each of ``keys`` is READY (its :meth:`state_of`), in one pass."""
        get = self.entries.get
        ready = SlotState.READY
        out = []
        for key in keys:
            entry = get(key)
            out.append(entry is not None and entry.state is ready)
        return out

    def full_ready(self, layer: int) -> int:
        """Experts of ``layer`` READY at full precision (not from the low tier): when that is every
        expert of the layer, no prefetch for it can help. Read from any thread as a hint."""
        return self._full_ready.get(layer, 0)

    def full_ready_total(self) -> int:
        """Experts READY at full precision in every layer (:meth:`full_ready` summed): when that is
        every routed expert of the model, no prefetch can help. Read from any thread as a hint."""
        return self._full_ready_total

    @property
    def held(self) -> bool:
        """Whether a :meth:`hold` is in force (no entry may leave or change its slot)."""
        return self._holds > 0

    def hold(self) -> None:
        """Hold every entry in place until :meth:`end_hold`: nothing is evicted (a request that
        needs a slot waits, as it does for pins; an upgrade of a low-tier copy gets no victim), so a
        READY entry at full precision stays READY in its slot with its bytes, and a compute thread
        may use its views without a pin (:meth:`ready_full`). Loads into free slots go on.

        Raises:
            StoreClosedError: the cache is closed.
        """
        self._check_open()
        self._holds += 1

    def ready_full(self, key: Key) -> Entry | None:
        """``key``'s entry if it is READY at full precision (not a low-tier copy), else None. Safe
        from any thread as a snapshot; under :meth:`hold` a READY entry stays so until it ends."""
        entry = self.entries.get(key)
        if entry is None or entry.state is not SlotState.READY or entry.low:
            return None
        return entry

    def ready_full_all(self, keys: Sequence[Key]) -> list[Entry] | None:
        """Every entry of ``keys`` if each is READY at full precision (:meth:`ready_full` of each,
        in one loop: a layer's table asks for 128 at once), else None. A snapshot, as
        :meth:`ready_full`."""
        get, ready = self.entries.get, SlotState.READY
        out: list[Entry] = []
        append = out.append
        for key in keys:
            entry = get(key)
            if entry is None or entry.state is not ready or entry.low:
                return None
            append(entry)
        return out

    def placements(self, layer: int) -> int:
        """A count of the changes of ``layer``'s placement so far (an entry of it made READY, or
        taken out of its slot): while it stays the same, every READY entry of the layer is in the
        slot it was in. Read from any thread as a hint."""
        return self._placements.get(layer, 0)

    def _placed(self, layer: int) -> None:
        self._placements[layer] = self._placements.get(layer, 0) + 1

    def end_hold(self) -> None:
        """End one :meth:`hold`; the last lets waiting requests evict and deferred upgrades run."""
        if self._holds <= 0:
            raise RuntimeError("end_hold() without hold()")
        self._holds -= 1
        if self._holds == 0 and not self.closed:
            if self._deferred:
                self._upgrade([])
            self._signal_space()

    @property
    def pinned_slots(self) -> int:
        """Entries with at least one pin (low copies retired while pinned included)."""
        return sum(1 for e in self.entries.values() if e.pins) + len(self._retired)

    # -- acquire / release ----------------------------------------------------------------------

    def pin_ready(self, keys: Sequence[Key]) -> list[Entry] | None:
        """Pin ``keys`` (unique) at once if every one is READY: the hit path, with nothing to await.

        The same bookkeeping as :meth:`acquire` (the policy's ``access``, counters, the task's
        pins); a request that needs no slot never queues behind waiting ones, so this is what
        :meth:`acquire` would do for it.

        Returns:
            The pinned entries in the order of ``keys`` (release them with :meth:`release`), or
            None, with nothing changed, when a key is missing or still loading.

        Raises:
            EvictionPolicyError: the policy's ``access`` raised (nothing is pinned).
            StoreClosedError: the cache is closed.
        """
        if self.closed:
            raise StoreClosedError("the store is closed")
        get = self.entries.get
        ready = SlotState.READY
        pinned = []
        for key in keys:
            entry = get(key)
            if entry is None or entry.state is not ready:
                return None
            pinned.append(entry)
        untracked = self._untracked
        access = self.policy.access
        key = pinned[0].key if pinned else (0, 0)
        try:  # decide first: a raising hook leaves no pin
            for entry in pinned:
                key = entry.key
                if not untracked or key not in untracked:
                    access(key)
        except Exception as exc:  # as _hook: stop trusting the policy about this key
            untracked.add(key)
            raise self._policy_error("access", exc) from exc
        c = self.counters
        demanded = prefetched = 0
        for entry in pinned:
            entry.pins += 1
            if entry.demanded:  # read by start_loads for this request: its miss, not a hit
                entry.demanded = False
                demanded += 1
                c.low_tier_misses += entry.low
            elif entry.prefetched:
                prefetched += 1
            elif entry.low and self.upgrade_low:  # a hit on a low-tier copy: served as it is, upgraded after
                entry.upgrade = True
            if entry.prefetched:
                entry.prefetched = False
                c.prefetch_hits += 1
                c.low_tier_prefetch_hits += entry.low
        n = len(pinned)
        c.requests += n
        c.hits += n - demanded
        c.misses += demanded
        c.demand_misses += demanded
        c.prefetched_in_time += prefetched
        c.cached_hits += n - demanded - prefetched
        task = self.loop.current_task()
        held = self._held
        held[task] = held.get(task, 0) + n
        return pinned

    async def acquire(
        self,
        keys: Sequence[Key],
        *,
        wait: bool = False,
        after_pin: Callable[[], object] | None = None,
        slot_timeout: float | None = None,
    ) -> list[Entry]:
        """Pin every expert of ``keys`` (duplicates allowed) and wait until all are READY.

        ``after_pin`` runs right after the entries are pinned and their loads queued, before
        waiting: the place to start prefetches, which then cannot evict what this call needs.
        With ``wait``, ``slot_timeout`` bounds the wait for slots (seconds; not the reads).

        Returns:
            The pinned entries, one per unique key in first-seen order. Release them with
            :meth:`release` exactly once.

        Raises:
            InvalidRequestError: a key the model does not have (nothing was pinned).
            SlabExhaustedError: more unique keys than slots; or (``wait=False``) not enough
                slots that are free, evictable, or loading without a pin (those are waited for,
                and only those: a request that does not wait never queues behind waiting ones);
                or (``wait=True``) the calling task already holds pins and would have to wait
                for slots, which could deadlock (release first, or ask for everything at once).
            SlotTimeoutError: no slot within ``slot_timeout`` (a ``SlabExhaustedError`` and a
                ``TimeoutError``).
            ExpertReadError: a load failed; the same error for every waiter of that expert.
            EvictionPolicyError: the eviction policy raised (nothing stays pinned).
            StoreClosedError: the cache was closed (also while waiting).

        Cancellation handling:
            Cancelling the caller unpins its entries and re-raises the cancellation; loads it
            started keep running to completion and their slots stay LOADING until then.
        """
        self._check_open()
        unique = list(dict.fromkeys(keys))
        entries, plan_get, plan_of = self.entries, self._plan_get, self.plan_of
        plans = {key: plan_get(key) or plan_of(*key) for key in unique if key not in entries}
        if len(unique) > self.n_slots:
            raise SlabExhaustedError(
                f"{len(unique)} experts requested at once but the slab has {self.n_slots} slots; open with more slots"
            )
        # nobody queued for slots: what _pin_now and _pin_in_turn would both do first, without
        # their coroutine (or the timeout's cancel scope) when the slots are there
        pinned_now = None if self._turns else self._pin_all(unique, plans)
        if pinned_now is not None:
            pinned = pinned_now
        elif not wait:
            pinned = await self._pin_now(unique, plans)
        elif slot_timeout is None:
            pinned = await self._pin_in_turn(unique, plans)
        else:
            try:
                with anyio.fail_after(slot_timeout):
                    pinned = await self._pin_in_turn(unique, plans)
            except TimeoutError:
                raise SlotTimeoutError(
                    f"no slot for {len(unique)} experts within {slot_timeout} s: {self.pinned_slots} of "
                    f"{self.n_slots} slots are pinned; open with more slots or a longer slot_timeout"
                ) from None
        task = self.loop.current_task()
        self._held[task] = self._held.get(task, 0) + len(pinned)
        try:
            if after_pin is not None:
                after_pin()
            waiter = self._waiter(pinned)
            if waiter is not None:
                await waiter.event.wait()
        except BaseException:
            self.release(pinned)
            raise
        failed = next((e for e in pinned if e.error is not None), None)
        if failed is not None or self.closed:
            self.release(pinned)
            if failed is not None and failed.error is not None:
                raise _for_this_waiter(failed.error)
            raise StoreClosedError("the store was closed while waiting for experts")
        return pinned

    async def _pin_now(self, unique: list[Key], plans: dict[Key, LoadPlan]) -> list[Entry]:
        """Pin ``unique`` without queuing behind waiting requests (``wait=False``).

        When the slots are short, waits only for the loads whose slots nobody pins (they become
        evictable when they complete), then tries once more.
        """
        pinned = self._pin_all(unique, plans)
        if pinned is not None:
            return pinned
        wanted = set(unique)
        loading = [
            e for e in self.entries.values() if e.state is SlotState.LOADING and not e.pins and e.key not in wanted
        ]
        if loading:
            waiter = self._waiter(loading)  # every one finishes by itself: a submitted read always completes
            if waiter is not None:
                await waiter.event.wait()
            self._check_open()
            pinned = self._pin_all(unique, plans)
            if pinned is not None:
                return pinned
        raise SlabExhaustedError(
            f"no free slot for {len(unique)} experts: {self.pinned_slots} of {self.n_slots} slots "
            "are pinned and the rest are loading; open with more slots or acquire with wait=True"
        )

    async def _pin_in_turn(self, unique: list[Key], plans: dict[Key, LoadPlan]) -> list[Entry]:
        """Pin ``unique``, waiting for slots; waiting requests are served first come, first served.

        A request that needs no new slot (every key cached) goes ahead; any other request queues
        behind the ones already waiting, so a large request is not starved by a stream of small
        ones.
        """
        ticket: AsyncEvent | None = None
        try:
            while True:
                needs_slots = any(key not in self.entries for key in unique)
                at_head = ticket is not None and self._turns[0] is ticket
                if not needs_slots or at_head or not self._turns:
                    pinned = self._pin_all(unique, plans)
                    if pinned is not None:
                        return pinned
                held = self._held.get(self.loop.current_task(), 0)
                if held:
                    raise SlabExhaustedError(
                        f"this task holds {held} pinned experts and asks for {len(unique)} more than the free "
                        f"slots allow: waiting for slots while holding pins can deadlock (the slots it waits for "
                        "may be the ones it holds); release them first, or request all the experts at once"
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

    def _pin_all(self, keys: list[Key], plans: dict[Key, LoadPlan]) -> list[Entry] | None:
        """Pin present entries and start loads for missing ones; None (and no change) if slots run out.

        Decides first (the victims to evict, the hits to report to the policy), then mutates.

        Raises:
            EvictionPolicyError: a policy hook raised; nothing is pinned or started (entries
                already evicted stay evicted: their slots are free).
        """
        entries = self.entries
        get = entries.get
        present: list[Entry] = []
        missing: list[Key] = []
        for key in keys:  # one pass: hits and misses
            found = get(key)
            if found is None:
                missing.append(key)
            else:
                present.append(found)
        plan_get, plan_of = plans.get, self.plan_of
        new_plans = [plan_get(key) or plan_of(*key) for key in missing]
        victims = self._choose_victims(len(missing) - len(self.free_slots), set(keys) if missing else ())
        if victims is None:
            return None
        if present:
            ready, untracked = SlotState.READY, self._untracked
            for entry in present:
                if entry.state is ready and entry.key not in untracked:
                    self._hook(self.policy.access, entry.key, "access")
        self._evict(victims)
        # mutation: nothing below calls out of the cache
        for entry in present:
            entry.pins += 1
        if missing:
            self._start_all(zip(missing, new_plans, repeat(False)), Priority.DEMAND, pins=1)
        c = self.counters
        c.requests += len(keys)
        c.misses += len(missing)
        c.demand_misses += len(missing)
        for entry in present:
            if entry.demanded:  # read by start_loads for this request: its miss
                entry.demanded = False
                c.misses += 1
                c.demand_misses += 1
                c.low_tier_misses += entry.low
            elif entry.state is SlotState.READY:
                c.hits += 1
                if entry.prefetched:
                    c.prefetched_in_time += 1
                else:
                    c.cached_hits += 1
                    if entry.low and self.upgrade_low:  # a hit on a low-tier copy: served as it is, upgraded after
                        entry.upgrade = True
            else:
                c.inflight_joins += 1
                if entry.prefetched:
                    c.prefetched_late += 1
                else:  # another request's demand read, shared
                    c.demand_misses += 1
                if entry.load is not None:
                    self.scheduler.promote(entry.load)
            if entry.prefetched:
                entry.prefetched = False
                c.prefetch_hits += 1
                c.low_tier_prefetch_hits += entry.low
        if not missing:
            return present  # every key was cached: these are the entries in the order of keys
        return [entries[key] for key in keys]

    def release(self, entries: Sequence[Entry], owner: object | None = None) -> None:
        """Unpin entries from :meth:`acquire` (synchronous, safe in cleanup code). ``owner``: the
        task that pinned them, whose count of pinned experts goes down (default the current task)."""
        if entries:
            task = self.loop.current_task() if owner is None else owner
            left = self._held.get(task, 0) - len(entries)
            if left > 0:
                self._held[task] = left
            else:
                self._held.pop(task, None)
        freed = False
        upgrades: list[Entry] = []
        for entry in entries:
            if self.entries.get(entry.key) is entry and entry.pins > 0:
                entry.pins -= 1
                freed |= entry.pins == 0 and entry.state is SlotState.READY
                if entry.upgrade and entry.pins == 0:
                    upgrades.append(entry)
            elif entry.retired and entry.pins > 0:  # a low copy its full copy replaced while pinned
                entry.pins -= 1
                if entry.pins == 0:
                    self._retired.discard(entry)
                    self._free_slot_of(entry)
                    freed = True
        if (upgrades or self._deferred) and not self.closed:
            self._upgrade(upgrades)
        if freed:
            self._signal_space()

    def _upgrade(self, entries: list[Entry]) -> None:
        """Read low-tier copies that were hit again (``entries``, and those put off before) at full
        precision, one at a time while the reads are not behind (``reads_behind``, asked again
        before each: an upgrade's own read counts); the others are put off. Never raises.

        The full copy is read into another slot (a free one, else the policy's victim, never the
        low copy) in the background; the low copy stays READY and serves every request until the
        full copy has landed, then :meth:`_upgraded` swaps them."""
        deferred = self._deferred
        waited = set(deferred)
        candidates = [*deferred.values(), *entries]
        deferred.clear()
        started = 0
        for entry in candidates:
            key = entry.key
            if key in deferred or self.entries.get(key) is not entry or key in self._upgrading:
                continue  # seen already, its copy left the cache, or its full copy is on the way
            if entry.state is not SlotState.READY or entry.pins or not entry.low:
                continue  # pinned again: its next release brings it back (entry.upgrade stays set)
            if self._reads_behind():
                deferred[key] = entry
                self.counters.tier_upgrades_deferred += key not in waited
                continue
            if not self.free_slots:
                try:
                    self._evict(self._choose_victims(1, (key,), partial=True) or [])
                except EvictionPolicyError:
                    log.exception("the eviction policy failed while a low-tier expert was upgraded")
                if not self.free_slots:
                    deferred[key] = entry  # no slot to read it into: tried again at a later release
                    continue
            entry.upgrade = False
            full = Entry(key, self.free_slots.pop(), self.plan_of(*key))
            full.load = Load(full.plan, full.slot, Priority.PREFETCH, self._loaded, full)
            self._upgrading[key] = full
            self.scheduler.enqueue(full.load)
            started += 1
        self.counters.tier_upgrades += started

    def _upgraded(self, full: Entry, error: AioExpertsError | None) -> None:
        """The full copy of an upgrade finished reading: it replaces the low copy (whose slot is
        freed now, or by its last release if a request pins it), or takes the key if the low copy
        left the cache meanwhile; on an error, or if another load of the key started since, its
        slot is freed and the cache keeps what it has. Never raises."""
        key = full.key
        del self._upgrading[key]
        full.load = None
        current = self.entries.get(key)
        if error is not None or (current is not None and not (current.low and current.state is SlotState.READY)):
            if isinstance(error, ExpertReadError):
                self.counters.read_errors += 1
            if error is not None and not isinstance(error, StoreClosedError):
                log.warning("the full-precision read of low-tier expert %s failed (%s); the low copy stays", key, error)
            self._free_slot_of(full)
            self._signal_space()
            return
        if current is None:  # the low copy was evicted meanwhile: the full copy comes in as a new load would
            try:
                if key in self._stale:
                    self._stale.discard(key)
                    self.policy.remove(key)
                self.policy.admit(key)
            except Exception:
                log.exception("the eviction policy failed to admit upgraded expert %s; its full copy is dropped", key)
                try:
                    self.policy.remove(key)
                except Exception:
                    self._stale.add(key)
                self._free_slot_of(full)
                self._signal_space()
                return
        # the swap: the key keeps its place in the policy (no admit, no remove), only its slot changes
        self.entries[key] = full
        full.state = SlotState.READY
        self._placed(key[0])
        self._full_ready[key[0]] = self._full_ready.get(key[0], 0) + 1
        self._full_ready_total += 1
        self.counters.payload_bytes += full.plan.payload_bytes
        if current is not None:
            if current.pins:
                current.retired = True
                self._retired.add(current)
            else:
                self._free_slot_of(current)
        self._signal_space()

    def _free_slot_of(self, entry: Entry) -> None:
        """``entry`` (out of ``entries``, no pin, no read in flight) is FREE: its slot goes back to the list."""
        entry.state = SlotState.FREE
        self._placed(entry.key[0])
        entry.drop_views()  # views of the slot's old bytes: the slot now goes to another expert
        self.free_slots.append(entry.slot)

    def _reads_behind(self) -> bool:
        """``reads_behind()``, False without one; True (upgrades wait) if it raises."""
        if self.reads_behind is None:
            return False
        try:
            return self.reads_behind()
        except Exception:
            log.exception("reads_behind failed; the upgrades wait")
            return True

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, keys: Sequence[Key], low: Sequence[Key] = ()) -> int:
        """Start loads for those of ``keys`` not cached, as far as free or evictable slots allow.

        Never waits and never raises for lack of space. A prefetch never evicts a pinned or
        loading entry, nor any entry of a layer it is prefetching for. Invalid keys raise
        ``InvalidRequestError`` before anything starts. The missing keys of ``low`` (a subset of
        ``keys``) are read from the low-precision miss tier (``low_plan_of``; ignored without one).

        Returns:
            The number of loads started.

        Raises:
            InvalidRequestError: a key the model does not have (nothing started).
            EvictionPolicyError: the eviction policy raised (nothing started).
            StoreClosedError: the cache is closed.
        """
        self._check_open()
        missing = [k for k in dict.fromkeys(keys) if k not in self.entries]
        plans = self._plans(missing, low)
        layers = {k[0] for k in missing}
        victims = self._choose_victims(len(missing) - len(self.free_slots), (), layers, partial=True)
        assert victims is not None
        self._evict(victims)
        return self._start_prefetches(plans)

    def _plans(self, keys: list[Key], low: Sequence[Key]) -> list[tuple[Key, LoadPlan, bool]]:
        """``(key, plan, low)`` of each of ``keys``: the low tier's plan for those in ``low`` (with
        a tier), else the full one. Raises InvalidRequestError for a key the model does not have."""
        plan_get, plan_of, low_plan_of = self._plan_get, self.plan_of, self.low_plan_of
        if not low or low_plan_of is None:
            return [(k, plan_get(k) or plan_of(*k), False) for k in keys]
        low_set = set(low)
        out = []
        for k in keys:
            plan = plan_get(k) or plan_of(*k)  # checks the key, for the low tier too
            low_plan = low_plan_of(*k) if k in low_set else None  # None: no low copy (a NextN block's)
            if low_plan is not None:
                out.append((k, low_plan, True))
            else:
                out.append((k, plan, False))
        return out

    def _start_prefetches(self, plans: list[tuple[Key, LoadPlan, bool]], priority: Priority = Priority.PREFETCH) -> int:
        """Start prefetch loads (of ``priority``) of ``plans`` in the free slots, in order, while there are any."""
        todo = plans[: len(self.free_slots)]
        started = self._start_all(todo, priority, prefetched=True)
        self.counters.prefetch_issued += started
        if self.low_plan_of is not None:
            self.counters.low_tier_prefetches += sum(1 for _, _, is_low in todo if is_low)
        return started

    def start_loads(
        self,
        demand: Sequence[Key],
        prefetch: Sequence[Key] = (),
        low: Sequence[Key] = (),
        low_prefetch: Sequence[Key] = (),
        speculative: Sequence[Key] = (),
    ) -> int:
        """Start the loads of a request's missing experts and of its prefetch, and submit them now.

        For a request that knows what it needs before it pins (the runner, the moment a layer's
        routing is known): the ``demand`` keys not cached are queued as demand loads (ahead of
        every prefetch), then the ``prefetch`` keys as prefetches, and the read queue is flushed
        in this call (one submission) instead of at the end of the loop tick, so that no compute
        job the caller starts next delays the reads. Like :meth:`prefetch` it never waits and
        never raises for lack of space (keys beyond the free and evictable slots are left for the
        request's :meth:`acquire`). ``demand`` is every key the request will pin (its hits too):
        none of them is evicted, nor a pinned or loading entry, nor (by the prefetch) an entry of
        a layer in ``prefetch``; the demand loads choose their victims as the request's
        :meth:`acquire` would. The request that pins a key started here counts it as a miss.
        The missing keys of ``low`` (a subset of ``demand``) and of ``low_prefetch`` (a subset of
        ``prefetch``) are read from the low-precision miss tier (``low_plan_of``; ignored without one).
        ``speculative`` keys (predictions further ahead) are started last as speculative loads,
        which the scheduler submits only while nothing else is queued and few reads are in flight
        (:data:`~aioexperts._cache.scheduler.SPECULATIVE_MAX_OPS`); a queued speculative load among
        ``prefetch`` becomes a prefetch, among ``demand`` a demand load. ``low_prefetch`` may name
        speculative keys too.

        Returns:
            The number of loads started (demand, prefetch and speculative).

        Raises:
            InvalidRequestError: a key the model does not have (nothing started).
            EvictionPolicyError: the eviction policy raised (nothing started).
            StoreClosedError: the cache is closed.
        """
        self._check_open()
        wanted = list(dict.fromkeys(demand))
        wanted_set = set(wanted)
        entries = self.entries
        ahead = [k for k in dict.fromkeys(prefetch) if k not in entries and k not in wanted_set]
        taken = wanted_set.union(ahead)
        further = [k for k in dict.fromkeys(speculative) if k not in entries and k not in taken]
        missing = [k for k in wanted if k not in entries]
        plans = self._plans(missing, low)
        ahead_plans = self._plans(ahead, low_prefetch)
        further_plans = self._plans(further, low_prefetch)
        promoted = 0
        if self.scheduler.has_speculative:  # the ones asked for now go to their nearer queue
            promote, speculative_priority = self.scheduler.promote, Priority.SPECULATIVE
            for keys, to in ((wanted, Priority.DEMAND), (prefetch, Priority.PREFETCH)):
                for k in keys:
                    entry = entries.get(k)
                    load = entry.load if entry is not None else None
                    if load is not None and load.priority is speculative_priority:
                        promote(load, to)
                        promoted += 1
        # the demand loads evict as the request's acquire would (anything but the request's own keys)
        victims = self._choose_victims(len(missing) - len(self.free_slots), wanted_set, partial=True)
        assert victims is not None
        self._evict(victims)
        started = self._start_all(plans[: len(self.free_slots)], Priority.DEMAND, demanded=True)
        # the prefetch evicts as prefetch() after the request's pins: not the request's keys, not its layers
        # ahead; then the speculative loads the same way, sparing the prefetch's layers too
        layers: set[int] = set()
        prefetched = 0
        for keys, key_plans, priority in (
            (ahead, ahead_plans, Priority.PREFETCH),
            (further, further_plans, Priority.SPECULATIVE),
        ):
            if not keys:
                continue
            layers |= {k[0] for k in keys}
            victims = self._choose_victims(len(keys) - len(self.free_slots), wanted_set, layers, partial=True)
            assert victims is not None
            self._evict(victims)
            prefetched += self._start_prefetches(key_plans, priority)
        if started or prefetched or promoted:
            self.scheduler.flush()
        return started + prefetched

    def drop_prefetches(self, keep: Callable[[Key], bool] = lambda key: False) -> int:
        """Drop queued (not yet submitted) prefetch loads whose key ``keep`` rejects.

        Returns:
            The number dropped; their slots are free again.
        """
        dropped = 0
        for load in self.scheduler.queued_prefetches():
            key = load.plan.key
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

    def _hook(self, hook: Callable[[Key], object], key: Key, name: str) -> None:
        """Call a policy hook on a cached ``key``; if it raises, stop trusting the policy about ``key``."""
        try:
            hook(key)
        except Exception as exc:
            self._untracked.add(key)
            raise self._policy_error(name, exc) from exc

    def _policy_error(self, hook: str, exc: BaseException) -> EvictionPolicyError:
        return EvictionPolicyError(
            f"the eviction policy {type(self.policy).__name__} raised in {hook}(): {exc!r}; "
            "the request was not served and holds no pins"
        )

    def _refused_victims(self, n: int, can_evict: Callable[[Key], bool]) -> None:
        """The policy chose fewer victims than the cache needs: fine if there are no more, an error
        (instead of a request waiting forever) if the cache sees evictable entries it did not offer."""
        evictable = sum(1 for key in self.entries if can_evict(key))
        if evictable >= n:
            raise EvictionPolicyError(
                f"the eviction policy {type(self.policy).__name__} offered no victim although {evictable} "
                f"entries can be evicted and {n} slots are needed; the request holds no pins"
            )

    def _choose_victims(
        self, n: int, spare: Container[Key], spare_layers: Container[int] = (), *, partial: bool = False
    ) -> list[Key] | None:
        """Choose ``n`` READY, unpinned entries to evict, without changing anything, sparing the keys
        in ``spare`` and every key of a layer in ``spare_layers``.

        Returns:
            The keys, or (unless ``partial``) None when fewer than ``n`` can be evicted.

        Raises:
            EvictionPolicyError: ``victim`` raised or chose a key it was not allowed to.
        """
        if n <= 0:
            return []
        if self._holds:  # nothing may leave its slot until the hold ends
            return [] if partial else None
        chosen: list[Key] = []
        taken: set[Key] = set()
        get = self.entries.get
        ready = SlotState.READY

        # one test per candidate key of the policy's walk (no predicate call inside it)
        def can_evict(key: Key) -> bool:
            entry = get(key)
            return (
                entry is not None
                and not entry.pins
                and entry.state is ready
                and key not in spare
                and key not in taken
                and key[0] not in spare_layers
            )

        for key in self._untracked:  # the policy may have lost these: the cache evicts them itself
            if len(chosen) == n:
                break
            if can_evict(key):
                chosen.append(key)
                taken.add(key)
        if len(chosen) < n:
            try:  # None, an int, a generator that raises: the policy's error, not the cache's
                found = list(self.policy.victims(n - len(chosen), can_evict))
            except Exception as exc:
                raise self._policy_error("victim", exc) from exc
            for victim in found:
                try:
                    evictable = can_evict(victim)
                except TypeError:  # unhashable: not a key
                    evictable = False
                if not evictable:
                    raise EvictionPolicyError(
                        f"the eviction policy {type(self.policy).__name__} chose {victim!r}, which is not an "
                        "evictable entry (pinned, loading, not cached or already chosen); the request holds no pins"
                    )
                chosen.append(victim)
                taken.add(victim)
        if len(chosen) < n and not partial:
            self._refused_victims(n - len(chosen), can_evict)
            return None
        return chosen[:n]

    def _evict(self, victims: list[Key]) -> None:
        """Evict ``victims`` (their slots go to the free list), then tell the policy.

        Raises:
            EvictionPolicyError: ``remove`` raised; every victim is evicted all the same.
        """
        if not victims:
            return
        for key in victims:
            self._placed(key[0])
        error: Exception | None = None
        pop, free, full_ready, untracked = self.entries.pop, self.free_slots.append, self._full_ready, self._untracked
        remove = self.policy.remove
        ready, free_state = SlotState.READY, SlotState.FREE
        wasted = 0
        for key in victims:
            entry = pop(key)
            if entry.state is ready and not entry.low:
                full_ready[key[0]] -= 1
                self._full_ready_total -= 1
            entry.state = free_state
            views = entry.views
            if views is not None:  # views of the slot's old bytes: the slot now goes to another expert
                entry.views = None
                views.invalidate()
            free(entry.slot)
            wasted += entry.prefetched
            was_untracked = False
            if untracked and key in untracked:
                untracked.discard(key)
                was_untracked = True
            try:
                remove(key)
            except Exception as exc:
                self._stale.add(key)
                if not was_untracked and error is None:
                    error = exc
        c = self.counters
        c.evictions += len(victims)
        c.prefetch_wasted += wasted
        if error is not None:
            self._signal_space()  # the evicted slots are free for whoever comes next
            raise self._policy_error("remove", error) from error

    def _waiter(self, entries: Sequence[Entry]) -> _Waiter | None:
        """What to wait on until none of ``entries`` is LOADING (their loads finished or were
        dropped): one event for the lot, set by the last of their loads to finish (:meth:`_wake`);
        None when none is loading."""
        waiter: _Waiter | None = None
        loading = SlotState.LOADING
        for entry in entries:
            if entry.state is loading:
                if waiter is None:
                    waiter = _Waiter(self.loop.new_event())
                    self._waiting.add(waiter)
                waiter.left += 1
                waiter.entries.append(entry)
                if entry.waiters is None:
                    entry.waiters = [waiter]
                else:
                    entry.waiters.append(waiter)
        return waiter

    def _wake(self, entry: Entry) -> None:
        """The entry's load finished or was dropped: count it off for every request waiting on it."""
        waiters, entry.waiters = entry.waiters, None
        if waiters is not None:
            for waiter in waiters:
                waiter.left -= 1
                if waiter.left == 0:
                    self._waiting.discard(waiter)
                    waiter.event.set()

    def _completions_needed(self) -> int | None:
        """The fewest read completions after which a waiting request can go on (its loads' reads
        still due, queued ones counted whole), 1 while a request waits for slots (any completion
        may free one), None when nobody waits (the scheduler's :attr:`~ReadScheduler.waiting_need`)."""
        if self._turns:
            return 1
        best: int | None = None
        loading, submitted = SlotState.LOADING, LoadState.SUBMITTED
        for waiter in self._waiting:
            n = 0
            for entry in waiter.entries:
                load = entry.load
                if load is not None and entry.state is loading:
                    n += load.ops_left if load.state is submitted else len(load.plan.reads)
            if best is None or n < best:
                best = n
        return best

    def _start_all(
        self,
        items: Iterable[tuple[Key, LoadPlan, bool]],
        priority: Priority,
        *,
        pins: int = 0,
        demanded: bool = False,
        prefetched: bool = False,
    ) -> int:
        """Start a load of ``priority`` for each ``(key, plan, low)`` of ``items``, each in a slot
        popped from the free list (the caller made sure there are enough), queued together.

        Returns:
            The number of loads started.

        Raises:
            StoreClosedError: the scheduler is closed (nothing was started).
        """
        scheduler = self.scheduler
        if scheduler.closed:  # before any change: no entry is left LOADING without a load queued
            raise StoreClosedError("the store is closed")
        entries, pop, loaded = self.entries, self.free_slots.pop, self._loaded
        loads: list[Load] = []
        for key, plan, low in items:
            slot = pop()
            entry = Entry(key, slot, plan, pins, low, demanded, prefetched)
            entry.load = load = Load(plan, slot, priority, loaded, entry)
            entries[key] = entry
            loads.append(load)
        scheduler.enqueue_all(loads, priority)
        return len(loads)

    def _undo_start(self, entry: Entry) -> bool:
        """Forget an entry whose load was never submitted; False (and no change) if it was."""
        assert entry.load is not None
        if not self.scheduler.drop(entry.load):
            return False
        del self.entries[entry.key]
        entry.state = SlotState.FREE
        self._placed(entry.key[0])
        entry.load = None
        self.free_slots.append(entry.slot)
        self._wake(entry)  # a request waiting for this slot to free up (wait=False) looks again
        return True

    def _loaded(self, load: Load) -> None:
        """``on_done`` of every load (its ``owner`` is the entry): READY, or FREE with the error for
        every waiter. Never raises."""
        entry: Entry = load.owner
        key = entry.key
        if self._upgrading and self._upgrading.get(key) is entry:
            self._upgraded(entry, load.error)
            return
        entry.load = None
        error = load.error
        self._placed(key[0])
        if error is None:
            try:
                if self._stale and key in self._stale:  # an earlier remove raised: the policy may still track it
                    self._stale.discard(key)
                    self.policy.remove(key)
                self.policy.admit(key)
            except Exception as exc:
                error = self._policy_error("admit", exc)
                error.__cause__ = exc
                try:  # it may have half-tracked the key
                    self.policy.remove(key)
                except Exception:
                    self._stale.add(key)
        if error is None:
            entry.state = SlotState.READY
            if not entry.low:
                full_ready = self._full_ready
                full_ready[key[0]] = full_ready.get(key[0], 0) + 1
                self._full_ready_total += 1
            self.counters.payload_bytes += entry.plan.payload_bytes
            if entry.pins == 0 and self._turns:
                self._turns[0].set()  # _signal_space
        else:
            if isinstance(error, ExpertReadError):
                self.counters.read_errors += 1
            entry.error = error
            entry.state = SlotState.FREE
            if self.entries.get(key) is entry:
                del self.entries[key]
            self.free_slots.append(entry.slot)  # the load's reads have all completed
            self._signal_space()
        if entry.waiters is not None:
            self._wake(entry)

    def _signal_space(self) -> None:
        """Slots may have become free or evictable: let the first request in line try again."""
        if self._turns:
            self._turns[0].set()

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError("the store is closed")

    def close(self) -> None:
        """Refuse new requests; close the scheduler; wake every waiter (they get ``StoreClosedError``).

        Loads not submitted yet fail at once and free their slots; loads already submitted keep
        their slots until they complete (await ``scheduler.wait_idle()`` for that). Idempotent.
        The policy may serve another cache afterwards.
        """
        _POLICY_OWNERS.pop(id(self.policy), None)
        if self.closed:
            return
        self.closed = True
        self.scheduler.close()  # queued loads finish now, through _loaded, with StoreClosedError
        for turn in self._turns:  # every request waiting for slots gets StoreClosedError
            turn.set()


def _for_this_waiter(error: BaseException) -> BaseException:
    """A copy of a load's ``error`` for one of the requests that waited for it (same type, message
    and cause): raising the one object in every waiting task grew its traceback by each task's
    frames and kept them alive. The load's own object when it cannot be copied."""
    try:
        fresh = copy.copy(error)
    except Exception:
        return error
    if type(fresh) is not type(error) or fresh is error:
        return error
    fresh.__cause__ = error.__cause__
    fresh.__traceback__ = None
    return fresh
