"""Trace replay: step semantics, counts, Belady's optimality, fractions and the table."""

from __future__ import annotations

import math
from functools import cache
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioexperts._errors import ConfigError
from aioexperts._predict.simulate import (
    REPLAY_POLICY_NAMES,
    ReplayResult,
    format_replay_table,
    replay,
    replay_fractions,
)
from aioexperts._predict.trace import RoutingTrace, skewed_random_trace, uniform_random_trace


def single_layer(refs: list[int], n_experts: int) -> RoutingTrace:
    return RoutingTrace(np.array(refs, dtype=np.int16).reshape(-1, 1, 1), [0], n_experts)


def steps_of(trace: RoutingTrace) -> list[frozenset[tuple[int, int]]]:
    return [
        frozenset((layer, int(e)) for e in trace.ids[t, i] if e >= 0)
        for t in range(trace.n_tokens)
        for i, layer in enumerate(trace.layers)
    ]


def brute_force_min_misses(trace: RoutingTrace, capacity: int) -> int:
    """The fewest misses over every possible choice of victims (exhaustive, memoized)."""
    steps = steps_of(trace)

    @cache
    def best(s: int, resident: frozenset[tuple[int, int]]) -> int:
        if s == len(steps):
            return 0
        step = steps[s]
        missing = step - resident
        need = max(0, len(resident) + len(missing) - capacity)
        evictable = sorted(resident - step)
        return len(missing) + min(
            best(s + 1, (resident - frozenset(victims)) | missing) for victims in combinations(evictable, need)
        )

    return best(0, frozenset())


def test_textbook_reference_string() -> None:
    # Silberschatz, Galvin, Gagne, "Operating System Concepts", the 3-frame example:
    # optimal 9 faults, LRU 12 faults.
    refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    results = replay(single_layer(refs, 8), 3, bytes_per_expert=1000)
    assert results["belady"].misses == 9
    assert results["lru"].misses == 12
    assert results["belady"].compulsory_misses == 6  # pages 7, 0, 1, 2, 3, 4
    assert results["belady"].evictions == 6
    assert results["belady"].bytes_read == 9000
    assert list(results) == list(REPLAY_POLICY_NAMES)
    for result in results.values():
        assert result.requests == 20
        assert result.hits + result.misses == 20
        assert result.hit_rate == result.hits / 20
        assert result.evictions == result.misses - 3


def test_policies_differ_on_a_small_trace() -> None:
    # 0 is hot early, then 1, 2, 3 cycle; capacity 2. Worked by hand: in-cache LFU keeps the stale 0
    # and thrashes the other slot; LFUDA ages 0 out only after several evictions.
    refs = [0, 0, 0, 0, 1, 2, 1, 2, 3, 1, 2, 3]
    results = replay(single_layer(refs, 4), 2)
    assert {name: r.misses for name, r in results.items()} == {"lru": 7, "lfu": 9, "lfuda": 9, "belady": 5}


def test_step_keys_are_pinned_together() -> None:
    # Two layers, k=2: each step needs two slots, and a step's experts never evict each other.
    ids = np.array([[[0, 1], [0, 1]], [[0, 1], [2, 3]]], dtype=np.int16)
    trace = RoutingTrace(ids, [1, 2], 4)
    results = replay(trace, 2)
    for result in results.values():
        # token 0: layer 1 {0,1} misses 2, layer 2 {0,1} misses 2 (evicts layer 1's);
        # token 1: layer 1 misses 2, layer 2 {2,3} misses 2.
        assert (result.requests, result.misses, result.evictions) == (8, 8, 6)
        assert result.n_steps == 4
    with pytest.raises(ConfigError, match=r"2 unique experts that token 0 requests at layer 1"):
        replay(trace, 1)


def test_inactive_and_duplicate_ids_are_not_requests() -> None:
    ids = np.array([[[3, 3, -1]], [[-1, -1, -1]], [[3, 1, 1]]], dtype=np.int16)
    results = replay(RoutingTrace(ids, [0], 4), 2)
    for result in results.values():
        assert (result.n_steps, result.requests, result.hits, result.misses) == (3, 3, 1, 2)
    # one slot is enough for steps of one unique id
    assert replay(RoutingTrace(ids[:2], [0], 4), 1)["lru"].requests == 1


def test_capacity_holding_everything_only_has_compulsory_misses() -> None:
    trace = skewed_random_trace(200, [1, 2, 3], 16, 4, seed=11)
    for result in replay(trace, trace.n_experts_total).values():
        assert result.evictions == 0
        assert result.misses == result.compulsory_misses
        assert result.compulsory_misses == sum(len(np.unique(trace.ids[:, i])) for i in range(3))


def test_empty_trace() -> None:
    result = replay(RoutingTrace(np.empty((0, 1, 2), np.int16), [0], 4), 2, ["belady"])["belady"]
    assert (result.requests, result.hits, result.misses) == (0, 0, 0)
    assert math.isnan(result.hit_rate)
    assert "n/a" in format_replay_table({"belady": result})


@pytest.mark.parametrize(
    ("capacity", "policies", "kwargs", "match"),
    [
        (0, ("lru",), {}, "positive"),
        (2.5, ("lru",), {}, "positive"),
        (True, ("lru",), {}, "positive"),
        (4, ("lru", "fifo"), {}, "lru, lfu, lfuda, belady"),
        (4, "lru", {}, "not the string"),
        (4, ("lru",), {"bytes_per_expert": -1}, "bytes_per_expert"),
    ],
)
def test_bad_arguments(capacity: object, policies: object, kwargs: dict[str, object], match: str) -> None:
    trace = uniform_random_trace(5, [0], 8, 2, seed=0)
    with pytest.raises(ConfigError, match=match):
        replay(trace, capacity, policies, **kwargs)  # type: ignore[arg-type]


def test_duplicate_policy_names_run_once() -> None:
    trace = uniform_random_trace(20, [0], 8, 2, seed=0)
    assert list(replay(trace, 4, ["lfu", "lru", "lfu"])) == ["lfu", "lru"]


def test_replay_fractions_and_table() -> None:
    trace = skewed_random_trace(100, range(1, 5), 32, 4, seed=2)
    by_fraction = replay_fractions(trace, bytes_per_expert=3 << 20)
    assert list(by_fraction) == [0.1, 0.25, 0.5]
    assert [r["lru"].capacity for r in by_fraction.values()] == [13, 32, 64]
    for results in by_fraction.values():
        assert results["belady"].hits >= max(r.hits for r in results.values())
    table = format_replay_table(by_fraction)
    lines = table.splitlines()
    assert len(lines) == 2 + 3 * 4
    assert lines[0].split() == "slots of all policy requests hits misses hit rate evictions read".split()
    assert "MiB" in table or "GiB" in table
    assert format_replay_table(by_fraction[0.25]) == "\n".join(lines[:2] + lines[6:10])
    assert format_replay_table(list(by_fraction[0.25].values())) == format_replay_table(by_fraction[0.25])
    with pytest.raises(ConfigError, match="positive finite"):
        replay_fractions(trace, [0.0])
    with pytest.raises(ConfigError, match="at least 4 slots"):
        replay_fractions(trace, [0.01])


def test_result_is_frozen() -> None:
    result = replay(uniform_random_trace(10, [0], 8, 2, seed=0), 4, ["lru"])["lru"]
    assert isinstance(result, ReplayResult)
    with pytest.raises(AttributeError):
        result.hits = 0  # type: ignore[misc]
    assert result.capacity_fraction == 0.5


def test_belady_replays_a_long_trace() -> None:
    trace = uniform_random_trace(2500, range(8), 128, 8, seed=0)  # 160,000 requests (speed: bench/trace_replay.py)
    result = replay(trace, 256, ["belady", "lru"])
    assert result["belady"].requests == result["lru"].requests == 160_000
    assert result["belady"].hits >= result["lru"].hits  # Belady is optimal


@st.composite
def small_traces(draw: st.DrawFn, max_tokens: int = 25, max_experts: int = 6) -> tuple[RoutingTrace, int]:
    n_layers = draw(st.integers(1, 3))
    n_experts = draw(st.lists(st.integers(1, max_experts), min_size=n_layers, max_size=n_layers))
    k = draw(st.integers(1, min(n_experts)))
    n_tokens = draw(st.integers(0, max_tokens))
    ids = np.array(
        [[[draw(st.integers(-1, n - 1)) for _ in range(k)] for n in n_experts] for _ in range(n_tokens)],
        dtype=np.int16,
    ).reshape(n_tokens, n_layers, k)
    trace = RoutingTrace(ids, list(range(1, n_layers + 1)), n_experts)
    largest_step = max((len(s) for s in steps_of(trace)), default=0)
    # mostly tight capacities, where the choice of victims matters
    capacity = max(1, largest_step) + draw(st.integers(0, 3))
    return trace, capacity


@settings(max_examples=120, deadline=None)
@given(case=small_traces())
def test_belady_beats_every_policy_and_counts_add_up(case: tuple[RoutingTrace, int]) -> None:
    trace, capacity = case
    results = replay(trace, capacity)
    total = sum(len(s) for s in steps_of(trace))
    for result in results.values():
        assert result.requests == total
        assert result.hits + result.misses == total
        assert result.compulsory_misses <= result.misses
        assert result.evictions == max(0, result.misses - capacity)  # the cache never shrinks
        assert results["belady"].hits >= result.hits
    assert results["belady"].compulsory_misses == results["lru"].compulsory_misses


@settings(max_examples=120, deadline=None)
@given(case=small_traces(max_tokens=7, max_experts=4))
def test_belady_equals_brute_force_optimum(case: tuple[RoutingTrace, int]) -> None:
    trace, capacity = case
    assert replay(trace, capacity, ["belady"])["belady"].misses == brute_force_min_misses(trace, capacity)


def test_belady_equals_brute_force_on_a_tricky_multi_key_trace() -> None:
    ids = np.array(
        [[[0, 1]], [[2, 3]], [[0, 2]], [[1, 3]], [[0, 3]], [[1, 2]], [[0, 1]], [[2, 3]]],
        dtype=np.int16,
    )
    trace = RoutingTrace(ids, [0], 4)
    for capacity in (2, 3, 4):
        assert replay(trace, capacity, ["belady"])["belady"].misses == brute_force_min_misses(trace, capacity)


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_lru_and_belady_replays_count_as_the_python_ones(seed: int) -> None:
    """LRU and Belady run compiled (``kernels/replay.py``) where numba serves: the same hits, misses,
    compulsory misses and evictions as the Python replays, at every capacity from the widest step to
    all experts, on uniform and skewed traces of several layers (ties of Belady's farthest next use,
    broken by the key, included: keys never used again tie)."""
    from aioexperts._compute.fused import compiled_kernel
    from aioexperts._predict import simulate

    if compiled_kernel("replay", "replay_lru") is None:
        pytest.skip("numba does not serve")
    rng = np.random.default_rng(seed)
    n_experts = [int(x) for x in rng.integers(4, 24, 3)]
    k = int(rng.integers(1, 4))
    if seed % 2:
        trace = uniform_random_trace(300, [0, 2, 5], n_experts, k, seed=seed)
    else:
        trace = skewed_random_trace(300, [0, 2, 5], n_experts, k, seed=seed, zipf_exponent=1.2, locality=0.3)
    steps = simulate._flatten(trace)
    widest = int(np.diff(steps.bounds).max())
    for capacity in range(widest, trace.n_experts_total + 1):
        got = simulate._replay("lru", steps, capacity), simulate._replay(simulate.BELADY, steps, capacity)
        want = simulate._replay_policy("lru", steps, capacity), simulate._replay_belady(steps, capacity)
        assert got == want, capacity


def test_slots_for_hit_rates_are_the_fewest_slots_that_reach_each_target() -> None:
    """``aioexperts-trace summary`` asks for several targets at once (the trace flattened once, a
    capacity replayed once for all): each answer is the smallest capacity whose replay reaches the
    target (a linear scan; LRU and Belady are stack algorithms), None where none does."""
    from aioexperts._predict.simulate import slots_for_hit_rate, slots_for_hit_rates

    trace = skewed_random_trace(400, [0, 1], [16, 16], 2, seed=7, zipf_exponent=1.1, locality=0.2)
    for policy in ("lru", "belady"):
        curve = {c: replay(trace, c, (policy,))[policy].hit_rate for c in range(2, trace.n_experts_total + 1)}
        targets = [0.3, curve[6], 0.5, 0.8, curve[20], 0.99, 1.0]  # two reached exactly at a capacity
        want = [next((c for c, r in curve.items() if r >= t), None) for t in targets]
        assert slots_for_hit_rates(trace, targets, policy) == want, policy
        assert [slots_for_hit_rate(trace, t, policy) for t in targets] == want
    assert want[-1] is None  # compulsory misses: 100 % is out of reach
    with pytest.raises(ConfigError, match="unknown replay policy"):
        slots_for_hit_rates(trace, [0.5], "fifo")


def test_slot_table_reports_each_replay_once_with_its_hit_rate() -> None:
    from aioexperts._predict.simulate import slot_table

    trace = skewed_random_trace(300, [0, 1], [16, 16], 2, seed=3, zipf_exponent=1.1, locality=0.2)
    seen: list[tuple[str, int, float]] = []
    table = slot_table(trace, [0.4, 0.6, 0.7], ("lru", "belady"), lambda p, c, r: seen.append((p, c, r)))
    assert set(table) == {"lru", "belady"} and len(seen) == len({(p, c) for p, c, _ in seen})
    for policy, capacity, rate in seen:
        assert rate == replay(trace, capacity, (policy,))[policy].hit_rate
    assert {p for p, _, _ in seen} == {"lru", "belady"}


def test_a_capacity_beyond_every_key_replays_as_every_key() -> None:
    """The compiled replays take an int64: ``10**30`` slots raised a bare OverflowError."""
    trace = skewed_random_trace(100, [0, 1], [8, 8], 2, seed=1, zipf_exponent=1.1, locality=0.2)
    for policy in ("lru", "belady"):
        big = replay(trace, 10**30, (policy,))[policy]
        full = replay(trace, 16, (policy,))[policy]
        assert (big.hits, big.misses, big.evictions, big.capacity) == (full.hits, full.misses, 0, 10**30)
