"""The expert-cache replays of :mod:`aioexperts._predict.simulate`, compiled: LRU and Belady's MIN.

Each takes a trace flattened to dense integer keys (``keys[bounds[s]:bounds[s + 1]]`` are the
distinct experts of step ``s``, every key in ``0..n_keys-1``) and returns ``(hits, misses,
compulsory misses, evictions)``, the counts of the Python replays they stand for
(``simulate._replay_policy("lru", ...)`` and ``simulate._replay_belady``), decision for decision:

* the keys of the current step are pinned (none of them is evicted while the step loads);
* LRU: a hit moves its key to the newest end, a miss evicts the oldest unpinned key when the
  cache is full, then enters at the newest end (the order of :class:`aioexperts._cache.eviction.LRU`);
* Belady: a max-heap of ``(next use, key)`` with lazy deletion, ties to the larger ``-key``
  (``heapq`` over ``(-next use, key)`` tuples pops the smallest tuple: the farthest next use, then
  the smallest key).

Memory is a few int64 arrays of the trace's length and of ``n_keys``, not Python objects per
request (a 400,000-token trace of 8 MoE layers and top-8 took gigabytes and minutes in Python).
"""

from __future__ import annotations

import numpy as np

from aioexperts._compute.jit import kernel


@kernel(cache=True)
def replay_lru(keys, bounds, n_keys, capacity):
    prev = np.full(n_keys, -1, np.int64)
    nxt = np.full(n_keys, -1, np.int64)
    resident = np.zeros(n_keys, np.bool_)
    seen = np.zeros(n_keys, np.bool_)
    pinned = np.full(n_keys, -1, np.int64)  # the step that pins the key
    missing = np.empty(_widest(bounds), np.int64)
    head = -1  # the oldest key
    tail = -1  # the newest key
    n_res = 0
    hits = 0
    misses = 0
    compulsory = 0
    evictions = 0
    for s in range(bounds.shape[0] - 1):
        a = bounds[s]
        b = bounds[s + 1]
        for p in range(a, b):
            pinned[keys[p]] = s
        n_miss = 0
        for p in range(a, b):
            k = keys[p]
            if resident[k]:
                hits += 1
                if k != tail:  # unlink, then append at the newest end
                    if prev[k] >= 0:
                        nxt[prev[k]] = nxt[k]
                    else:
                        head = nxt[k]
                    after = nxt[k]  # >= 0: k is not the newest
                    prev[after] = prev[k]
                    prev[k] = tail
                    nxt[k] = -1
                    nxt[tail] = k
                    tail = k
            else:
                missing[n_miss] = k
                n_miss += 1
        for i in range(n_miss):
            k = missing[i]
            misses += 1
            if not seen[k]:
                compulsory += 1
                seen[k] = True
            if n_res >= capacity:
                v = head
                while v >= 0 and pinned[v] == s:
                    v = nxt[v]
                if v < 0:  # every resident key is pinned: the caller checked the capacity
                    return -1, -1, -1, -1
                if prev[v] >= 0:
                    nxt[prev[v]] = nxt[v]
                else:
                    head = nxt[v]
                if nxt[v] >= 0:
                    prev[nxt[v]] = prev[v]
                else:
                    tail = prev[v]
                prev[v] = -1
                nxt[v] = -1
                resident[v] = False
                n_res -= 1
                evictions += 1
            prev[k] = tail
            nxt[k] = -1
            if tail >= 0:
                nxt[tail] = k
            else:
                head = k
            tail = k
            resident[k] = True
            n_res += 1
    return hits, misses, compulsory, evictions


@kernel(cache=False)
def _widest(bounds):
    """The most keys of one step (at least 1)."""
    width = 1
    for s in range(bounds.shape[0] - 1):
        width = max(width, bounds[s + 1] - bounds[s])
    return width


@kernel(cache=False, inline=True)
def _before(n1, k1, n2, k2):
    """``(n1, k1) < (n2, k2)``: the heap's order (``n`` the negated next use)."""
    return n1 < n2 or (n1 == n2 and k1 < k2)


@kernel(cache=False)
def _push(hn, hk, size, n, k):
    """Push ``(n, k)`` on the heap of ``size`` entries (``hn``/``hk`` have room); the new size."""
    i = size
    while i > 0:
        parent = (i - 1) // 2
        if not _before(n, k, hn[parent], hk[parent]):
            break
        hn[i] = hn[parent]
        hk[i] = hk[parent]
        i = parent
    hn[i] = n
    hk[i] = k
    return size + 1


@kernel(cache=False)
def _pop(hn, hk, size):
    """Remove the smallest entry of the heap of ``size`` (> 0) entries; the new size (the entry was
    at index 0 before the call: read it first)."""
    size -= 1
    n = hn[size]
    k = hk[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and _before(hn[child + 1], hk[child + 1], hn[child], hk[child]):
            child += 1
        if not _before(hn[child], hk[child], n, k):
            break
        hn[i] = hn[child]
        hk[i] = hk[child]
        i = child
    if size > 0:
        hn[i] = n
        hk[i] = k
    return size


@kernel(cache=False)
def _push_grown(hn, hk, size, n, k):
    """:func:`_push`, the heap's arrays doubled first when full; ``(hn, hk, size)`` after it."""
    if size == hn.shape[0]:
        hn2 = np.empty(2 * size, np.int64)
        hk2 = np.empty(2 * size, np.int64)
        hn2[:size] = hn[:size]
        hk2[:size] = hk[:size]
        hn = hn2
        hk = hk2
    return hn, hk, _push(hn, hk, size, n, k)


@kernel(cache=True)
def replay_belady(keys, bounds, n_keys, capacity):
    n = keys.shape[0]
    never = n
    next_use = np.empty(n, np.int64)
    last = np.full(n_keys, never, np.int64)
    for p in range(n - 1, -1, -1):
        k = keys[p]
        next_use[p] = last[k]
        last[k] = p
    res = np.full(n_keys, -1, np.int64)  # a resident key's next use; -1: not resident
    seen = np.zeros(n_keys, np.bool_)
    step_of = np.full(n_keys, -1, np.int64)
    skipped_n = np.empty(_widest(bounds), np.int64)
    skipped_k = np.empty(_widest(bounds), np.int64)
    hn = np.empty(2 * n + 16, np.int64)
    hk = np.empty(2 * n + 16, np.int64)
    size = 0
    n_res = 0
    hits = 0
    misses = 0
    compulsory = 0
    evictions = 0
    for s in range(bounds.shape[0] - 1):
        a = bounds[s]
        b = bounds[s + 1]
        for p in range(a, b):
            step_of[keys[p]] = s
        for p in range(a, b):
            k = keys[p]
            if res[k] >= 0:
                hits += 1
                res[k] = next_use[p]
                hn, hk, size = _push_grown(hn, hk, size, -next_use[p], k)
        for p in range(a, b):
            k = keys[p]
            if res[k] >= 0:
                continue
            misses += 1
            if not seen[k]:
                compulsory += 1
                seen[k] = True
            if n_res >= capacity:
                n_skipped = 0
                while True:
                    if size == 0:  # every resident key is pinned: the caller checked the capacity
                        return -1, -1, -1, -1
                    top_n = hn[0]
                    top_k = hk[0]
                    size = _pop(hn, hk, size)
                    if res[top_k] != -top_n:
                        continue  # stale
                    if step_of[top_k] == s:
                        skipped_n[n_skipped] = top_n
                        skipped_k[n_skipped] = top_k
                        n_skipped += 1
                        continue
                    res[top_k] = -1
                    n_res -= 1
                    evictions += 1
                    break
                for i in range(n_skipped):
                    size = _push(hn, hk, size, skipped_n[i], skipped_k[i])
            res[k] = next_use[p]
            n_res += 1
            hn, hk, size = _push_grown(hn, hk, size, -next_use[p], k)
    return hits, misses, compulsory, evictions
