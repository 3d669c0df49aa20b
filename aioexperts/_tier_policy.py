"""Which reads of a layer step go to the low-precision miss tier (:class:`~aioexperts.MissTier`):
its demand misses and the prefetch of the layers ahead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ._cache.cache import Key
from ._options import MissTier
from ._router import Routing

__all__ = ("low_tier_misses", "low_tier_prefetches")


def low_tier_misses(
    tier: MissTier, misses: Sequence[int], calls: Sequence[Routing], backlog_seconds: float | None
) -> list[int]:
    """The experts of ``misses`` (ids of one layer step) that ``tier``'s policy sends to the low tier.

    An expert's gate weight is its largest routing weight over every row of every call of the step
    (a token that needs it much keeps it at full precision).

    Args:
        tier: the policy.
        misses: expert ids of the step that are not resident.
        calls: the step's routings (their ``ids`` and ``weights``, ``(n_tokens, k)``).
        backlog_seconds: how far the reads are behind (``ExpertStore.read_backlog_seconds``).
    """
    if not misses:
        return []
    weight: dict[int, float] = {}
    for call in calls:
        ids, weights = np.asarray(call.ids), np.asarray(call.weights)
        for e, w in zip(ids.ravel().tolist(), weights.ravel().tolist(), strict=True):
            if w > weight.get(e, -1.0):
                weight[e] = w
    return [e for e in misses if tier.goes_low(weight.get(e, 0.0), backlog_seconds)]


def low_tier_prefetches(
    tier: MissTier, keys: Sequence[Key], weights: Mapping[Key, float], backlog_seconds: float | None
) -> list[Key]:
    """The prefetch ``keys`` (``(layer, expert)`` of the layers ahead) that ``tier``'s policy sends
    to the low tier: none unless ``tier.prefetches``.

    A key's gate weight is its predicted one in ``weights`` (the predictor's largest over the rows,
    :meth:`~aioexperts.predictors.Predictor.predict_weighted`); a key without one has an unknown
    weight, and only the backlog rule (or no rule at all: every read low) sends it low.

    Args:
        tier: the policy.
        keys: the step's prefetch (keys already cached are not read whatever is chosen).
        weights: predicted gate weights of some of ``keys``.
        backlog_seconds: how far the reads are behind (``ExpertStore.read_backlog_seconds``).
    """
    if not keys or not tier.prefetches:
        return []
    return [k for k in keys if tier.goes_low(weights.get(k), backlog_seconds)]
