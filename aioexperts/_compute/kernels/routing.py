"""The softmax router's selection as two compiled loops around numpy's ``exp``
(:func:`aioexperts._compute.gating.select_experts`'s fast path).

Bit for bit the numpy steps they replace, so the kernels are ``exact`` (IEEE float32 operation by
operation) and copy numpy's orders where the order shows in the result:

* :func:`shift_rows`: ``x - max(x)`` per row (``max`` does not depend on the order; a NaN makes it
  NaN, as numpy's does; a ``-0.0`` or ``0.0`` maximum differs only in the sign of a zero that
  ``exp`` maps to 1 either way);
* ``exp`` stays numpy's (its SIMD float32 ``exp`` is not libm's);
* :func:`finish_softmax_top_k`: the float64 row sum in numpy's pairwise order
  (``_pairwise_sum`` of ``numpy/_core/src/umath/loops_utils.h.src``: 8 accumulators per block of
  at most 128, halves above, added to the identity 0; written out as four levels of halves, not
  as a recursion, which numba does not cache reliably: rows of at most :data:`MAX_EXPERTS`),
  ``* float32(1 / sum)``, the top-k as
  ``argsort(-p, kind="stable")[:k]`` orders it (descending, ties to the lower index, NaN last), the
  gathered weights, their float32 sum (the same pairwise order, one block: k at most
  :data:`MAX_USED`), the clamp, the division and the
  scale.
"""

from __future__ import annotations

import numpy as np

from aioexperts._compute.jit import kernel

MAX_EXPERTS = 1024
"""The widest router row the float64 sum takes (four levels of halves down to numpy's blocks of 128)."""

MAX_USED = 128
"""The most experts per token the float32 weight sum takes (one of numpy's blocks)."""


@kernel(exact=True, cache=False)
def _block64(a, lo, n):
    if n < 8:
        res = 0.0
        for i in range(n):
            res += np.float64(a[lo + i])
        return res
    if n <= 128:
        r0 = np.float64(a[lo])
        r1 = np.float64(a[lo + 1])
        r2 = np.float64(a[lo + 2])
        r3 = np.float64(a[lo + 3])
        r4 = np.float64(a[lo + 4])
        r5 = np.float64(a[lo + 5])
        r6 = np.float64(a[lo + 6])
        r7 = np.float64(a[lo + 7])
        i = 8
        end = n - n % 8
        while i < end:
            r0 += np.float64(a[lo + i])
            r1 += np.float64(a[lo + i + 1])
            r2 += np.float64(a[lo + i + 2])
            r3 += np.float64(a[lo + i + 3])
            r4 += np.float64(a[lo + i + 4])
            r5 += np.float64(a[lo + i + 5])
            r6 += np.float64(a[lo + i + 6])
            r7 += np.float64(a[lo + i + 7])
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += np.float64(a[lo + i])
            i += 1
        return res


@kernel(exact=True, cache=False)
def _pairwise64_1(a, lo, n):
    if n <= 128:
        return _block64(a, lo, n)
    n2 = n // 2
    n2 -= n2 % 8
    return _block64(a, lo, n2) + _block64(a, lo + n2, n - n2)


@kernel(exact=True, cache=False)
def _pairwise64_2(a, lo, n):
    if n <= 128:
        return _block64(a, lo, n)
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise64_1(a, lo, n2) + _pairwise64_1(a, lo + n2, n - n2)


@kernel(exact=True, cache=False)
def _pairwise64_3(a, lo, n):
    if n <= 128:
        return _block64(a, lo, n)
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise64_2(a, lo, n2) + _pairwise64_2(a, lo + n2, n - n2)


@kernel(exact=True, cache=False)
def _pairwise64_4(a, lo, n):
    if n <= 128:
        return _block64(a, lo, n)
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise64_3(a, lo, n2) + _pairwise64_3(a, lo + n2, n - n2)


@kernel(exact=True, cache=False)
def _block32(a, lo, n):
    if n < 8:
        res = np.float32(0.0)
        for i in range(n):
            res += a[lo + i]
        return res
    if n <= 128:
        r0 = a[lo]
        r1 = a[lo + 1]
        r2 = a[lo + 2]
        r3 = a[lo + 3]
        r4 = a[lo + 4]
        r5 = a[lo + 5]
        r6 = a[lo + 6]
        r7 = a[lo + 7]
        i = 8
        end = n - n % 8
        while i < end:
            r0 += a[lo + i]
            r1 += a[lo + i + 1]
            r2 += a[lo + i + 2]
            r3 += a[lo + i + 3]
            r4 += a[lo + i + 4]
            r5 += a[lo + i + 5]
            r6 += a[lo + i + 6]
            r7 += a[lo + i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[lo + i]
            i += 1
        return res


@kernel(exact=True)
def shift_rows(logits):
    n, m = logits.shape
    out = np.empty((n, m), dtype=np.float32)
    for t in range(n):
        top = logits[t, 0]
        for j in range(1, m):
            if top != top:
                break
            v = logits[t, j]
            if v > top or v != v:
                top = v
        for j in range(m):
            out[t, j] = logits[t, j] - top
    return out


@kernel(exact=True)
def finish_softmax_top_k(e, k, norm, sum_min, scaled, scale):
    n, m = e.shape
    ids = np.empty((n, k), dtype=np.int32)
    weights = np.empty((n, k), dtype=np.float32)
    taken = np.zeros(m, dtype=np.bool_)
    for t in range(n):
        row = e[t]
        total = 0.0 + _pairwise64_4(row, 0, m)
        inv = np.float32(1.0 / total)
        for j in range(m):
            row[j] = row[j] * inv
            taken[j] = False
        w = weights[t]
        for s in range(k):
            best = -1
            for j in range(m):
                if taken[j]:
                    continue
                if best < 0:
                    best = j
                    continue
                v = row[j]
                b = row[best]
                if v > b or (b != b and v == v):
                    best = j
            taken[best] = True
            ids[t, s] = best
            w[s] = row[best]
        if norm:
            wsum = np.float32(0.0) + _block32(w, 0, k)
            if wsum < sum_min:  # a NaN sum stays NaN, as np.maximum keeps it
                wsum = sum_min
            for s in range(k):
                w[s] = w[s] / wsum
        if scaled:
            for s in range(k):
                w[s] = w[s] * scale
    return ids, weights
