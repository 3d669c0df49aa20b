"""Eviction policies of the expert cache: which resident, unpinned expert to drop next.

The cache owns the slots and their states (FREE -> LOADING -> READY) and the pin counts; a policy
only keeps an *order* over the keys that are READY and tells the cache which one to evict. Keys are
``(layer, expert)`` tuples of ints. The protocol between cache and policy is:

- :meth:`EvictionPolicy.admit` when a slot becomes READY (counts as the first access);
- :meth:`EvictionPolicy.access` on every hit of a READY key;
- :meth:`EvictionPolicy.victim` when a slot is needed; it only *chooses*, it does not forget the key;
- :meth:`EvictionPolicy.remove` once the key has left the cache (evicted, or dropped for any reason).

Pinned keys stay tracked by the policy; the cache passes ``can_evict`` (``not pinned``) to
:meth:`~EvictionPolicy.victim`, which skips the keys it rejects without changing their place in the
order.

Frequencies are *in-cache* (the "in-cache LFU" of the Web-caching literature, as opposed to
"perfect LFU"): a key's count starts at 1 on :meth:`~EvictionPolicy.admit` and is forgotten on
:meth:`~EvictionPolicy.remove`. Perfect LFU would need memory for every expert ever seen and lets
experts that were hot long ago squat in the slab; LFUDA's aging is the standard remedy for the
remaining cache pollution of in-cache LFU.

Policies are not thread-safe: the cache calls them from the event loop thread only.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

from .._errors import ConfigError

__all__ = (
    "LFU",
    "LFUDA",
    "LRU",
    "POLICY_NAMES",
    "EvictionPolicy",
    "Key",
    "make_policy",
)

Key = tuple[int, int]
"""``(layer, expert)``: the block index ``L`` of ``blk.L.*`` and the global expert id."""


class EvictionPolicy(ABC):
    """An order over the resident keys of the expert cache.

    Methods that receive a key the policy does not expect raise :class:`KeyError`: that is a bug in
    the caller (the cache), not a user error, so it is deliberately outside the ``AioExpertsError``
    tree.

    Attributes:
        name: the registry name used by :func:`make_policy` (``"lru"``, ``"lfu"``, ``"lfuda"``).
    """

    name: ClassVar[str]

    @abstractmethod
    def admit(self, key: Key) -> None:
        """Start tracking ``key``, which just became resident; counts as one access.

        Raises:
            KeyError: if ``key`` is already tracked.
        """

    @abstractmethod
    def access(self, key: Key) -> None:
        """Record a hit on the resident ``key``.

        Raises:
            KeyError: if ``key`` is not tracked.
        """

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Stop tracking ``key``, which left the cache. A key that is not tracked is ignored.

        Ignoring unknown keys lets the cache call this for a load that failed before the key was
        ever admitted.
        """

    @abstractmethod
    def victim(self, can_evict: Callable[[Key], bool]) -> Key | None:
        """The key to evict next among the tracked keys for which ``can_evict(key)`` is true.

        The key stays tracked until :meth:`remove` is called. Keys rejected by ``can_evict`` keep
        their place in the order.

        Args:
            can_evict: a predicate, usually "the slot is not pinned". It may be called on any number
                of tracked keys, in policy order, and must not call back into the policy.

        Returns:
            The chosen key, or ``None`` when no tracked key is evictable (none tracked, or all pinned).
        """

    def victims(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key]:
        """Up to ``n`` distinct keys to evict next, in eviction order (see :meth:`victim`).

        The default asks :meth:`victim` ``n`` times, each time excluding the keys already chosen;
        a policy that can walk its order once (LRU) overrides it, which keeps evicting many keys
        at once (a prefill batch, a call for hundreds of rows) linear instead of quadratic.
        """
        chosen: list[Key] = []
        taken: set[Key] = set()

        def not_taken(key: Key) -> bool:
            return key not in taken and can_evict(key)

        while len(chosen) < n:
            key = self.victim(not_taken)
            if key is None or key in taken:
                break
            chosen.append(key)
            taken.add(key)
        return chosen

    @abstractmethod
    def __len__(self) -> int:
        """The number of tracked keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and any history (frequencies, the LFUDA age)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} tracking {len(self)} keys>"


class LRU(EvictionPolicy):
    """Least recently used: evict the key whose last admit or access is the oldest.

    One ``OrderedDict`` from oldest to newest: every operation is O(1); :meth:`victim` walks from the
    oldest key past the pinned ones, so it costs O(1 + number of pinned keys older than the victim).
    """

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def admit(self, key: Key) -> None:
        if key in self._order:
            raise KeyError(f"{key!r} is already tracked")
        self._order[key] = None

    def access(self, key: Key) -> None:
        self._order.move_to_end(key)  # KeyError when not tracked

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, can_evict: Callable[[Key], bool]) -> Key | None:
        for key in self._order:
            if can_evict(key):
                return key
        return None

    def victims(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key]:
        if type(self).victim is not LRU.victim:  # a subclass chooses its own way: ask it
            return super().victims(n, can_evict)
        chosen: list[Key] = []
        for key in self._order:  # one walk from the oldest key
            if len(chosen) == n:
                break
            if can_evict(key):
                chosen.append(key)
        return chosen

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def clear(self) -> None:
        self._order.clear()


# A heap entry: (priority, tick of the last access, key). Ticks are unique, so two entries never
# compare equal on the first two fields and keys are never compared.
_Entry = tuple[int, int, Key]


class _HeapPolicy(EvictionPolicy):
    """A min-heap over ``(priority, last access tick)`` with lazy deletion.

    Every admit or access pushes a fresh entry; an entry is live only while its tick is the key's
    last tick, stale entries are dropped when they reach the top. When stale entries outnumber live
    ones the heap is rebuilt, so memory stays O(n) and every operation is O(log n) amortised.
    Subclasses define the priority from the in-cache frequency.
    """

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        # key -> (frequency, priority, tick of the last admit or access)
        self._state: dict[Key, tuple[int, int, int]] = {}
        self._tick = 0

    @abstractmethod
    def _priority(self, frequency: int) -> int:
        """The priority of a key with this in-cache ``frequency``, computed now."""

    def _push(self, key: Key, frequency: int) -> None:
        self._tick += 1
        priority = self._priority(frequency)
        self._state[key] = (frequency, priority, self._tick)
        heapq.heappush(self._heap, (priority, self._tick, key))
        if len(self._heap) > 2 * len(self._state) + 64:
            self._heap = [entry for entry in self._heap if self._is_live(entry)]
            heapq.heapify(self._heap)

    def _is_live(self, entry: _Entry) -> bool:
        state = self._state.get(entry[2])
        return state is not None and state[2] == entry[1]

    def admit(self, key: Key) -> None:
        if key in self._state:
            raise KeyError(f"{key!r} is already tracked")
        self._push(key, 1)

    def access(self, key: Key) -> None:
        self._push(key, self._state[key][0] + 1)  # KeyError when not tracked

    def remove(self, key: Key) -> None:
        # The key's heap entries become stale; they are dropped lazily.
        self._state.pop(key, None)

    def victim(self, can_evict: Callable[[Key], bool]) -> Key | None:
        heap = self._heap
        skipped: list[_Entry] = []
        found: Key | None = None
        while heap:
            entry = heap[0]
            if not self._is_live(entry):
                heapq.heappop(heap)
            elif can_evict(entry[2]):
                found = entry[2]
                break
            else:
                skipped.append(heapq.heappop(heap))
        for entry in skipped:  # rejected keys go back unchanged: their order is kept
            heapq.heappush(heap, entry)
        return found

    def frequency(self, key: Key) -> int:
        """The in-cache access count of the tracked ``key`` (its admit counts as 1).

        Raises:
            KeyError: if ``key`` is not tracked.
        """
        return self._state[key][0]

    def priority(self, key: Key) -> int:
        """The current priority of the tracked ``key``; the lowest is evicted first.

        Raises:
            KeyError: if ``key`` is not tracked.
        """
        return self._state[key][1]

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def clear(self) -> None:
        self._heap.clear()
        self._state.clear()


class LFU(_HeapPolicy):
    """Least frequently used, in-cache: evict the key with the fewest accesses since its admission.

    Ties go to the least recently used key. A min-heap with lazy deletion: O(log n) amortised per
    operation, plus O(log n) per pinned key that :meth:`victim` skips.
    """

    name: ClassVar[str] = "lfu"

    def _priority(self, frequency: int) -> int:
        return frequency


class LFUDA(_HeapPolicy):
    """LFU with dynamic aging: evict the key with the lowest priority ``K = frequency + L``.

    ``L`` (the cache age, :attr:`age`) starts at 0 and, on each eviction, becomes the priority ``K``
    of the evicted key; a key's ``K`` is computed with the ``L`` of the moment of its last admit or
    access. Keys that were hot long ago thus lose to keys used recently, which in-cache LFU never
    lets happen. This is the cost- and size-free form (``C = S = 1``) of LFU-DA from M. Arlitt,
    L. Cherkasova, J. Dilley, R. Friedrich, T. Jin, "Evaluating content management techniques for
    Web proxy caches", ACM SIGMETRICS Performance Evaluation Review 27(4), 2000.

    Every tracked key that leaves through :meth:`remove` counts as evicted for aging:
    ``L = max(L, K(key))``. When the removed key is the policy's victim and nothing is pinned it
    has the minimum ``K``, which is never below ``L``, so this is exactly the paper's rule; the
    ``max`` keeps ``L`` non-decreasing when the cache removes some other key. Ties go to the least
    recently used key. Same costs as :class:`LFU`.
    """

    name: ClassVar[str] = "lfuda"

    def __init__(self) -> None:
        super().__init__()
        self._age = 0

    @property
    def age(self) -> int:
        """The cache age ``L``: the priority of the last evicted key (0 before any eviction)."""
        return self._age

    def _priority(self, frequency: int) -> int:
        return frequency + self._age

    def remove(self, key: Key) -> None:
        state = self._state.get(key)
        if state is not None:
            self._age = max(self._age, state[1])
        super().remove(key)

    def clear(self) -> None:
        super().clear()
        self._age = 0


_REGISTRY: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRU, LFU, LFUDA)}

POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)
"""The names :func:`make_policy` accepts, default first."""


def make_policy(name: str) -> EvictionPolicy:
    """A new, empty eviction policy by name.

    Args:
        name: ``"lru"`` (the default of the cache), ``"lfu"`` or ``"lfuda"``; case-insensitive.

    Raises:
        ConfigError: if ``name`` is not one of those.
    """
    cls = _REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"unknown eviction policy {name!r}; valid names: {', '.join(POLICY_NAMES)}")
    return cls()
