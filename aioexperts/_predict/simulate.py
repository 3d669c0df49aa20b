"""Replay a routing trace through a simulated expert cache: hit rates per eviction policy.

The simulation follows the store (docs/notes/DESIGN.md, "The path of one token"): for each token, for each
MoE layer in order, the *step* requests the unique active ids of that (token, layer) together.
They must all be resident at once and are pinned for the step, so they cannot evict each other; a
missing expert takes a free slot, or evicts the policy's victim among the unpinned residents. No
prefetching: the counts are those of demand loads only.

Besides the online policies of :mod:`aioexperts._cache.eviction` the replay runs Belady's optimal
offline policy (MIN), the bound no online policy can beat on the same trace and capacity.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .._cache.eviction import POLICY_NAMES, Key, make_policy
from .._errors import ConfigError
from .trace import RoutingTrace

__all__ = (
    "BELADY",
    "REPLAY_POLICY_NAMES",
    "ReplayResult",
    "expert_frequencies",
    "format_bytes",
    "format_replay_table",
    "replay",
    "replay_fractions",
    "slots_for_hit_rate",
    "slot_table",
    "slots_for_hit_rates",
)

BELADY = "belady"
"""The name of Belady's optimal offline policy in :func:`replay`."""

REPLAY_POLICY_NAMES: tuple[str, ...] = (*POLICY_NAMES, BELADY)
"""Every policy name :func:`replay` accepts."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """The outcome of replaying one trace through one policy at one capacity.

    Attributes:
        policy: the policy name (``"lru"``, ``"lfu"``, ``"lfuda"``, ``"belady"``).
        capacity: the number of cache slots.
        n_experts_total: distinct ``(layer, expert)`` keys of the model, to read ``capacity`` as a
            fraction of all experts.
        n_steps: (token, layer) steps replayed, including steps with no active id.
        requests: expert requests, i.e. unique active ids summed over steps; ``hits + misses``.
        hits: requests found resident.
        misses: requests that had to be loaded.
        compulsory_misses: misses on a key's first request (no policy can avoid them).
        evictions: resident keys dropped to make room.
        bytes_read: ``misses * bytes_per_expert``, or ``None`` when no expert size was given.
    """

    policy: str
    capacity: int
    n_experts_total: int
    n_steps: int
    requests: int
    hits: int
    misses: int
    compulsory_misses: int
    evictions: int
    bytes_read: int | None = None

    @property
    def hit_rate(self) -> float:
        """``hits / requests``; NaN when there were no requests."""
        return self.hits / self.requests if self.requests else math.nan

    @property
    def capacity_fraction(self) -> float:
        """``capacity / n_experts_total``."""
        return self.capacity / self.n_experts_total


@dataclass(frozen=True, slots=True)
class _Steps:
    """A trace flattened to dense integer keys: ``keys[bounds[s]:bounds[s + 1]]`` is step ``s``."""

    keys: np.ndarray  # int64, each in 0..len(key_tuples)-1, ordered as the (layer, expert) keys are
    bounds: np.ndarray  # int64, one more than the steps
    key_tuples: list[Key]  # dense key -> (layer, expert), for the keys the trace uses


def _flatten(trace: RoutingTrace) -> _Steps:
    ids = np.sort(trace.ids.astype(np.int64), axis=2)
    active = ids >= 0
    active[..., 1:] &= ids[..., 1:] != ids[..., :-1]  # unique within a step
    offsets = np.concatenate(([0], np.cumsum(trace.n_experts)[:-1])).astype(np.int64)
    keys = (ids + offsets[None, :, None])[active]  # row-major: token, then layer, then id
    counts = active.sum(axis=2).reshape(-1)
    bounds = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    # dense keys of the experts the trace uses (order kept): memory grows with the trace, not with
    # its declared expert counts
    total = int(trace.n_experts_total)
    if total <= max(4 * keys.size, 1 << 16):  # a table of every key: O(N), no sort of the requests
        present = np.zeros(total, dtype=np.bool_)
        present[keys] = True
        used = np.flatnonzero(present).astype(np.int64)
        dense = (np.cumsum(present, dtype=np.int64) - 1)[keys]
    else:
        used, dense = np.unique(keys, return_inverse=True)
    layer_of = np.asarray(np.searchsorted(offsets, used, side="right"), dtype=np.int64) - 1
    key_tuples = [(trace.layers[int(layer_of[j])], int(used[j] - offsets[layer_of[j]])) for j in range(len(used))]
    return _Steps(dense.astype(np.int64).reshape(-1), bounds, key_tuples)


def _check_capacity(trace: RoutingTrace, steps: _Steps, capacity: int) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ConfigError(f"capacity must be a positive int, got {capacity!r}")
    sizes = np.diff(steps.bounds)
    if sizes.size and int(sizes.max()) > capacity:
        step = int(np.argmax(sizes))
        token, i = divmod(step, trace.n_layers)
        raise ConfigError(
            f"a cache of {capacity} slots cannot hold the {int(sizes[step])} unique experts that token"
            f" {token} requests at layer {trace.layers[i]} at once; use at least {int(sizes.max())} slots"
        )


def _replay_policy(name: str, steps: _Steps, capacity: int) -> tuple[int, int, int, int]:
    """Hits, misses, compulsory misses, evictions of an online policy."""
    policy = make_policy(name)
    key_tuples = steps.key_tuples
    keys, bounds = steps.keys.tolist(), steps.bounds.tolist()
    resident: set[Key] = set()
    seen: set[Key] = set()
    pinned: set[Key] = set()

    def can_evict(key: Key) -> bool:
        return key not in pinned

    hits = misses = compulsory = evictions = 0
    for s in range(len(bounds) - 1):
        step = [key_tuples[k] for k in keys[bounds[s] : bounds[s + 1]]]
        pinned = set(step)
        missing = []
        for key in step:
            if key in resident:
                hits += 1
                policy.access(key)
            else:
                missing.append(key)
        for key in missing:
            misses += 1
            if key not in seen:
                compulsory += 1
                seen.add(key)
            if len(resident) >= capacity:
                victim = policy.victim(can_evict)
                if victim is None:  # pragma: no cover - excluded by _check_capacity
                    raise AssertionError("every resident expert is pinned")
                policy.remove(victim)
                resident.discard(victim)
                evictions += 1
            resident.add(key)
            policy.admit(key)
    return hits, misses, compulsory, evictions


def _replay_belady(steps: _Steps, capacity: int) -> tuple[int, int, int, int]:
    """Hits, misses, compulsory misses, evictions of Belady's MIN.

    On a miss with a full cache, evict the unpinned resident key whose next request is farthest in
    the future (never requested again counts as infinitely far). L. A. Belady, "A study of
    replacement algorithms for a virtual-storage computer", IBM Systems Journal 5(2), 1966.

    Next uses are precomputed in one backward pass; residents sit in a max-heap keyed by next use
    with lazy deletion (an entry is live while it matches the key's current next use, which strictly
    increases per key). O(N log N) for N requests. Keys of the current step are the only pinned
    ones; they are popped and pushed back, at most ``k`` per eviction.
    """
    keys, bounds = steps.keys.tolist(), steps.bounds.tolist()
    n = len(keys)
    never = n  # beyond every position
    next_use = [never] * n
    last: dict[int, int] = {}
    for p in range(n - 1, -1, -1):
        key = keys[p]
        next_use[p] = last.get(key, never)
        last[key] = p
    resident: dict[int, int] = {}  # key -> position of its next request
    heap: list[tuple[int, int]] = []  # (-next use, key)
    seen: set[int] = set()
    hits = misses = compulsory = evictions = 0
    for s in range(len(bounds) - 1):
        start, stop = bounds[s], bounds[s + 1]
        step = set(keys[start:stop])
        for p in range(start, stop):
            key = keys[p]
            if key in resident:
                hits += 1
                resident[key] = next_use[p]
                heapq.heappush(heap, (-next_use[p], key))
        for p in range(start, stop):
            key = keys[p]
            if key in resident:
                continue
            misses += 1
            if key not in seen:
                compulsory += 1
                seen.add(key)
            if len(resident) >= capacity:
                skipped = []
                while True:
                    entry = heapq.heappop(heap)
                    neg_next, candidate = entry
                    if resident.get(candidate) != -neg_next:
                        continue  # stale
                    if candidate in step:
                        skipped.append(entry)
                        continue
                    del resident[candidate]
                    evictions += 1
                    break
                for entry in skipped:
                    heapq.heappush(heap, entry)
            resident[key] = next_use[p]
            heapq.heappush(heap, (-next_use[p], key))
    return hits, misses, compulsory, evictions


#: the compiled replays (:mod:`aioexperts._compute.kernels.replay`), the same counts as the Python ones
_COMPILED = {"lru": "replay_lru", BELADY: "replay_belady"}


def _replay(name: str, steps: _Steps, capacity: int) -> tuple[int, int, int, int]:
    """Hits, misses, compulsory misses, evictions of policy ``name`` (capacity checked): LRU and
    Belady compiled where numba serves, the Python replays otherwise and for LFU and LFUDA."""
    kernel = _COMPILED.get(name)
    if kernel is not None:
        from .._compute.fused import compiled_kernel

        fn = compiled_kernel("replay", kernel)
        if fn is not None:
            # slots beyond the keys the trace uses are never filled: the same counts (and an int64)
            got = fn(steps.keys, steps.bounds, len(steps.key_tuples), min(int(capacity), len(steps.key_tuples)))
            if got[0] >= 0:  # -1: a step wider than the capacity (excluded by _check_capacity)
                return int(got[0]), int(got[1]), int(got[2]), int(got[3])
    if name == BELADY:
        return _replay_belady(steps, capacity)
    return _replay_policy(name, steps, capacity)


def replay(
    trace: RoutingTrace,
    capacity: int,
    policies: Sequence[str] = REPLAY_POLICY_NAMES,
    *,
    bytes_per_expert: int | None = None,
) -> dict[str, ReplayResult]:
    """Replay ``trace`` through a cache of ``capacity`` slots, once per policy.

    Each run starts from an empty cache. Cost: O(N) for LRU, O(N log N) for the others, N being the
    number of requests; LRU and Belady run compiled (:mod:`aioexperts._compute.kernels.replay`, the
    same counts) where numba serves: tens of millions of requests take about a second (LRU) and a
    few seconds (Belady) per capacity, in a few int64 arrays of N.

    Args:
        trace: the routing trace.
        capacity: cache slots, at least the largest number of unique active ids in one step.
        policies: names from :data:`REPLAY_POLICY_NAMES` (``"lru"``, ``"lfu"``, ``"lfuda"``,
            ``"belady"``); duplicates are run once.
        bytes_per_expert: the bytes read per miss (an expert's span), to report ``bytes_read``.

    Returns:
        One :class:`ReplayResult` per policy name, in the order given.

    Raises:
        ConfigError: if ``capacity`` is not a positive int or is smaller than the unique ids of some
            step, if a policy name is unknown, or if ``bytes_per_expert`` is negative.
    """
    if isinstance(policies, str):
        raise ConfigError(f"policies must be a sequence of names, not the string {policies!r}")
    unknown = [p for p in policies if p not in REPLAY_POLICY_NAMES]
    if unknown:
        raise ConfigError(f"unknown replay policies {unknown}; valid names: {', '.join(REPLAY_POLICY_NAMES)}")
    if bytes_per_expert is not None and (
        isinstance(bytes_per_expert, bool) or not isinstance(bytes_per_expert, int) or bytes_per_expert < 0
    ):
        raise ConfigError(f"bytes_per_expert must be a non-negative int or None, got {bytes_per_expert!r}")
    steps = _flatten(trace)
    _check_capacity(trace, steps, capacity)
    capacity = int(capacity)
    results: dict[str, ReplayResult] = {}
    for name in dict.fromkeys(policies):
        hits, misses, compulsory, evictions = _replay(name, steps, capacity)
        results[name] = ReplayResult(
            policy=name,
            capacity=capacity,
            n_experts_total=trace.n_experts_total,
            n_steps=len(steps.bounds) - 1,
            requests=len(steps.keys),
            hits=hits,
            misses=misses,
            compulsory_misses=compulsory,
            evictions=evictions,
            bytes_read=None if bytes_per_expert is None else misses * bytes_per_expert,
        )
    return results


def replay_fractions(
    trace: RoutingTrace,
    fractions: Iterable[float] = (0.1, 0.25, 0.5),
    policies: Sequence[str] = REPLAY_POLICY_NAMES,
    *,
    bytes_per_expert: int | None = None,
) -> dict[float, dict[str, ReplayResult]]:
    """:func:`replay` at capacities that are fractions of all experts of the trace's model.

    The capacity for fraction ``f`` is ``max(1, round(f * trace.n_experts_total))``.

    Returns:
        ``{fraction: {policy: ReplayResult}}`` in the order of ``fractions``.

    Raises:
        ConfigError: if a fraction is not a positive finite number, or as :func:`replay` (notably when
            a fraction gives fewer slots than one step needs).
    """
    out: dict[float, dict[str, ReplayResult]] = {}
    for fraction in fractions:
        if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and fraction > 0):
            raise ConfigError(f"fractions must be positive finite numbers, got {fraction!r}")
        capacity = max(1, round(fraction * trace.n_experts_total))
        out[fraction] = replay(trace, capacity, policies, bytes_per_expert=bytes_per_expert)
    return out


def format_bytes(n_bytes: int) -> str:
    """``n_bytes`` in B, KiB, MiB or GiB (binary units), two decimals above bytes."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_replay_table(
    results: Mapping[str, ReplayResult] | Mapping[float, Mapping[str, ReplayResult]] | Iterable[ReplayResult],
) -> str:
    """A plain-text table of replay results, one row per result, in the order given.

    Args:
        results: what :func:`replay` or :func:`replay_fractions` return, or any iterable of
            :class:`ReplayResult`.

    Returns:
        The table, lines joined by ``\\n``, without a trailing newline. The ``read`` column appears
        when some result has ``bytes_read``.
    """
    rows: list[ReplayResult] = []
    items = results.values() if isinstance(results, Mapping) else results
    for item in items:
        if isinstance(item, ReplayResult):
            rows.append(item)
        else:
            rows.extend(item.values())
    with_bytes = any(r.bytes_read is not None for r in rows)
    header = ["slots", "of all", "policy", "requests", "hits", "misses", "hit rate", "evictions"]
    if with_bytes:
        header.append("read")
    table = [header]
    for r in rows:
        line = [
            str(r.capacity),
            f"{100 * r.capacity_fraction:.1f}%",
            r.policy,
            str(r.requests),
            str(r.hits),
            str(r.misses),
            "n/a" if math.isnan(r.hit_rate) else f"{100 * r.hit_rate:.2f}%",
            str(r.evictions),
        ]
        if with_bytes:
            line.append("n/a" if r.bytes_read is None else format_bytes(r.bytes_read))
        table.append(line)
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    left = {2}  # the policy column is text
    lines = [
        "  ".join(
            cell.ljust(w) if c in left else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def slots_for_hit_rate(trace: RoutingTrace, hit_rate: float, policy: str = BELADY) -> int | None:
    """The fewest cache slots at which ``policy`` reaches ``hit_rate`` on ``trace``, or None.

    Hit rates of LRU and Belady never fall as slots are added (both are stack algorithms,
    Mattson et al., "Evaluation techniques for storage hierarchies", IBM Systems Journal 1970),
    so a binary search over the capacity finds the answer with about ``log2(n_experts_total)``
    replays. LFU and LFUDA are not stack algorithms: for them the answer is where the search ends,
    and a larger capacity could, rarely, hit less.

    Args:
        trace: the routing trace.
        hit_rate: the target, in ``(0, 1]``.
        policy: a name from :data:`REPLAY_POLICY_NAMES`.

    Returns:
        The slot count, or None when even one slot per expert of the model misses the target
        (compulsory misses: every expert's first request misses whatever the size).

    Raises:
        ConfigError: ``hit_rate`` outside ``(0, 1]``, an unknown policy, or an empty trace.
    """
    return slots_for_hit_rates(trace, [hit_rate], policy)[0]


def slots_for_hit_rates(trace: RoutingTrace, hit_rates: Sequence[float], policy: str = BELADY) -> list[int | None]:
    """:func:`slot_table` of one policy: :func:`slots_for_hit_rate` of each of ``hit_rates``.

    Raises:
        ConfigError: as :func:`slots_for_hit_rate`.
    """
    return slot_table(trace, hit_rates, (policy,))[policy]


def slot_table(
    trace: RoutingTrace,
    hit_rates: Sequence[float],
    policies: Sequence[str] = ("lru", BELADY),
    progress: Callable[[str, int, float], None] | None = None,
) -> dict[str, list[int | None]]:
    """Per policy, :func:`slots_for_hit_rate` of each of ``hit_rates`` (``aioexperts-trace summary``):
    the trace flattened once, each capacity replayed at most once per policy for all the targets.
    ``progress(policy, capacity, hit_rate)`` is called after each replay (a large trace takes
    seconds per Belady replay: tens of millions of requests).

    Raises:
        ConfigError: as :func:`slots_for_hit_rate`.
    """
    for hit_rate in hit_rates:
        if isinstance(hit_rate, bool) or not isinstance(hit_rate, int | float) or not 0 < hit_rate <= 1:
            raise ConfigError(f"hit_rate must be a number in (0, 1], got {hit_rate!r}")
    for policy in policies:
        if policy not in REPLAY_POLICY_NAMES:
            raise ConfigError(f"unknown replay policy {policy!r}; valid names: {', '.join(REPLAY_POLICY_NAMES)}")
    steps = _flatten(trace)
    if not len(steps.keys):
        raise ConfigError("the trace has no expert requests")
    widest = max(1, int(np.diff(steps.bounds).max()))  # the widest step must fit
    requests = len(steps.keys)
    table: dict[str, list[int | None]] = {}
    for policy in dict.fromkeys(policies):
        rates: dict[int, float] = {}

        def rate(capacity: int, policy: str = policy, rates: dict[int, float] = rates) -> float:
            if capacity not in rates:
                rates[capacity] = _replay(policy, steps, capacity)[0] / requests
                if progress is not None:
                    progress(policy, capacity, rates[capacity])
            return rates[capacity]

        out: list[int | None] = []
        for hit_rate in hit_rates:
            low, high = widest, max(widest, trace.n_experts_total)
            if rate(high) < hit_rate:
                out.append(None)
                continue
            while low < high:
                mid = (low + high) // 2
                if rate(mid) >= hit_rate:
                    high = mid
                else:
                    low = mid + 1
            out.append(low)
        table[policy] = out
    return table


def expert_frequencies(trace: RoutingTrace) -> dict[int, np.ndarray]:
    """Per MoE layer, how many tokens selected each expert (a token choosing one twice counts once).

    Returns:
        block index -> ``(n_experts,)`` int64 counts.
    """
    out = {}
    for i, (layer, n) in enumerate(zip(trace.layers, trace.n_experts, strict=True)):
        ids = np.sort(trace.ids[:, i, :].astype(np.int64), axis=1)
        first = np.ones(ids.shape, dtype=bool)
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]
        chosen = ids[(ids >= 0) & first]
        out[layer] = np.bincount(chosen, minlength=n).astype(np.int64)
    return out
