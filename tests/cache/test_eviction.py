"""Eviction policies: exact victims on hand-made sequences, pin skipping, and model-based properties."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioexperts._cache.eviction import LFU, LFUDA, LRU, POLICY_NAMES, EvictionPolicy, Key, make_policy
from aioexperts._errors import ConfigError

ALL: tuple[type[EvictionPolicy], ...] = (LRU, LFU, LFUDA)


def anything(key: Key) -> bool:
    return True


def k(expert: int, layer: int = 0) -> Key:
    return (layer, expert)


def not_in(pinned: frozenset[Key]) -> Callable[[Key], bool]:
    return lambda key: key not in pinned


def diverging_history(policy: EvictionPolicy) -> None:
    """A history after which LRU, LFU and LFUDA each pick a different victim.

    ``e`` is old and very hot (10 accesses), ``a`` is old and warm (3 accesses), then five keys come
    and go (LFUDA's age climbs 0 -> 5), then ``c`` arrives (1 access). LRU evicts the oldest (``e``),
    LFU the least used (``c``), LFUDA the lowest ``frequency + age at last access``: ``a`` (3 + 0)
    before ``c`` (1 + 5) and ``e`` (10 + 0).
    """
    policy.admit(k(0))  # e
    for _ in range(9):
        policy.access(k(0))
    policy.admit(k(1))  # a
    policy.access(k(1))
    policy.access(k(1))
    for x in range(100, 105):
        policy.admit(k(x))
        policy.remove(k(x))  # for LFUDA, the age becomes K(x) = 1 + age
    policy.admit(k(2))  # c


@pytest.mark.parametrize(("cls", "expected"), [(LRU, k(0)), (LFU, k(2)), (LFUDA, k(1))])
def test_policies_pick_different_victims(cls: type[EvictionPolicy], expected: Key) -> None:
    policy = cls()
    diverging_history(policy)
    assert len(policy) == 3
    assert policy.victim(anything) == expected


def test_lfuda_priorities_and_age() -> None:
    policy = LFUDA()
    diverging_history(policy)
    assert policy.age == 5
    assert policy.priority(k(0)) == 10
    assert policy.priority(k(1)) == 3
    assert policy.priority(k(2)) == 6
    # Evicting a (K=3) does not lower the age: it stays 5, the max seen.
    policy.remove(k(1))
    assert policy.age == 5
    # c (6) now goes before e (10); evicting c raises the age to 6, and a new key gets 1 + 6.
    assert policy.victim(anything) == k(2)
    policy.remove(k(2))
    assert policy.age == 6
    policy.admit(k(3))
    assert policy.priority(k(3)) == 7
    assert policy.frequency(k(0)) == 10
    policy.clear()
    assert policy.age == 0
    assert len(policy) == 0


@pytest.mark.parametrize("cls", [LFU, LFUDA])
def test_frequency_ties_go_to_least_recent(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    for x in (5, 3, 4):
        policy.admit(k(x))
    assert policy.victim(anything) == k(5)
    policy.access(k(5))
    policy.access(k(3))
    # 5 and 3 have 2 accesses, 4 has 1
    assert policy.victim(anything) == k(4)
    policy.access(k(4))
    # all have 2; 5 was accessed least recently
    assert policy.victim(anything) == k(5)


def test_lfu_frequency_is_in_cache() -> None:
    policy = LFU()
    policy.admit(k(1))
    for _ in range(5):
        policy.access(k(1))
    policy.remove(k(1))
    policy.admit(k(1))
    assert policy.frequency(k(1)) == 1


@pytest.mark.parametrize("cls", ALL)
def test_can_evict_skipping_keeps_order(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    for x in range(6):
        policy.admit(k(x))
    pinned = {k(0), k(1), k(3)}
    assert policy.victim(lambda key: key not in pinned) == k(2)
    # Asking repeatedly gives the same answer and skipping did not reorder anything.
    assert policy.victim(lambda key: key not in pinned) == k(2)
    order = []
    while (victim := policy.victim(anything)) is not None:
        order.append(victim)
        policy.remove(victim)
    assert order == [k(x) for x in range(6)]


@pytest.mark.parametrize("cls", ALL)
def test_victim_none_when_empty_or_all_pinned(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    assert policy.victim(anything) is None
    policy.admit(k(1))
    policy.admit(k(2))
    assert policy.victim(lambda key: False) is None
    assert policy.victim(anything) == k(1)


@pytest.mark.parametrize("cls", ALL)
def test_misuse_raises_key_error_and_remove_is_idempotent(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    policy.admit(k(1))
    with pytest.raises(KeyError):
        policy.admit(k(1))
    with pytest.raises(KeyError):
        policy.access(k(2))
    policy.remove(k(2))  # a failed load was never admitted: ignored
    policy.remove(k(1))
    policy.remove(k(1))
    assert len(policy) == 0
    assert k(1) not in policy


@pytest.mark.parametrize("cls", [LFU, LFUDA])
def test_heap_stays_bounded_under_many_accesses(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    for x in range(10):
        policy.admit(k(x))
    for i in range(10_000):
        policy.access(k(i % 3))
    assert len(policy._heap) <= 2 * len(policy) + 65  # type: ignore[attr-defined]
    assert policy.victim(anything) == k(3)


def test_make_policy() -> None:
    assert POLICY_NAMES == ("lru", "lfu", "lfuda")
    for name in POLICY_NAMES:
        policy = make_policy(name)
        assert policy.name == name
        assert len(policy) == 0
    assert isinstance(make_policy("LRU"), LRU)
    assert make_policy("lru") is not make_policy("lru")
    with pytest.raises(ConfigError, match="lru, lfu, lfuda") as info:
        make_policy("fifo")
    assert isinstance(info.value, ValueError)


# --- model-based properties -----------------------------------------------------------------------


class ModelPolicy:
    """Brute-force reference: every key's (priority, last tick); the victim is the evictable minimum."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.freq: dict[Key, int] = {}
        self.prio: dict[Key, int] = {}
        self.tick: dict[Key, int] = {}
        self.now = 0
        self.age = 0

    def touch(self, key: Key, freq: int) -> None:
        self.now += 1
        self.freq[key] = freq
        self.tick[key] = self.now
        self.prio[key] = {"lru": 0, "lfu": freq, "lfuda": freq + self.age}[self.kind]

    def remove(self, key: Key) -> None:
        if key in self.freq:
            if self.kind == "lfuda":
                self.age = max(self.age, self.prio[key])
            del self.freq[key], self.prio[key], self.tick[key]

    def victim(self, can_evict: Callable[[Key], bool]) -> Key | None:
        candidates = [key for key in self.freq if can_evict(key)]
        return min(candidates, key=lambda key: (self.prio[key], self.tick[key]), default=None)


class LruList:
    """The simplest LRU there is: a list from least to most recently used."""

    def __init__(self) -> None:
        self.order: list[Key] = []

    def admit(self, key: Key) -> None:
        self.order.append(key)

    def access(self, key: Key) -> None:
        self.order.remove(key)
        self.order.append(key)

    def remove(self, key: Key) -> None:
        if key in self.order:
            self.order.remove(key)

    def victim(self, can_evict: Callable[[Key], bool]) -> Key | None:
        return next((key for key in self.order if can_evict(key)), None)


keys_st = st.tuples(st.integers(0, 1), st.integers(0, 5))
ops_st = st.lists(
    st.tuples(
        st.sampled_from(["touch", "touch", "remove", "victim", "evict"]),
        keys_st,
        st.frozensets(keys_st, max_size=4),  # pinned keys for victim / evict
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops_st)
def test_lru_matches_list_model(ops: list[tuple[str, Key, frozenset[Key]]]) -> None:
    policy, model = LRU(), LruList()
    for op, key, pinned in ops:
        if op == "touch":
            if key in policy:
                policy.access(key)
                model.access(key)
            else:
                policy.admit(key)
                model.admit(key)
        elif op == "remove":
            policy.remove(key)
            model.remove(key)
        else:
            victim = policy.victim(not_in(pinned))
            assert victim == model.victim(not_in(pinned))
            if op == "evict" and victim is not None:
                policy.remove(victim)
                model.remove(victim)
        assert len(policy) == len(model.order)
        assert list(policy._order) == model.order


@pytest.mark.parametrize("cls", ALL)
@settings(max_examples=150, deadline=None)
@given(ops=ops_st)
def test_policy_matches_brute_force_model(
    cls: type[EvictionPolicy], ops: list[tuple[str, Key, frozenset[Key]]]
) -> None:
    policy, model = cls(), ModelPolicy(cls.name)
    for op, key, pinned in ops:
        if op == "touch":
            if key in policy:
                policy.access(key)
                model.touch(key, model.freq[key] + 1)
            else:
                policy.admit(key)
                model.touch(key, 1)
        elif op == "remove":
            policy.remove(key)
            model.remove(key)
        else:
            asked: list[Key] = []

            def can_evict(x: Key, pinned: frozenset[Key] = pinned, asked: list[Key] = asked) -> bool:
                asked.append(x)
                return x not in pinned

            victim = policy.victim(can_evict)
            assert victim == model.victim(not_in(pinned))
            assert all(x in model.freq for x in asked)  # only resident keys are offered
            if victim is not None:
                assert victim in policy
                assert victim not in pinned
            else:
                assert all(x in pinned for x in model.freq)
            if op == "evict" and victim is not None:
                policy.remove(victim)
                model.remove(victim)
        assert len(policy) == len(model.freq)
        assert all(x in policy for x in model.freq)
        if isinstance(policy, LFUDA):
            assert policy.age == model.age


def test_lru_chooses_many_victims_in_one_walk_in_the_same_order_as_one_by_one() -> None:
    from aioexperts._cache.eviction import EvictionPolicy

    lru = LRU()
    for e in range(2000):
        lru.admit((0, e))
    for e in range(0, 2000, 3):
        lru.access((0, e))
    pinned = {(0, e) for e in range(0, 2000, 7)}
    calls = 0

    def can_evict(key: tuple[int, int]) -> bool:
        nonlocal calls
        calls += 1
        return key not in pinned

    fast = lru.victims(900, can_evict)
    assert calls <= 2000  # one walk, not one walk per victim
    assert fast == EvictionPolicy.victims(lru, 900, lambda k: k not in pinned)  # the one-by-one answer
    assert len(set(fast)) == 900 and not set(fast) & pinned
