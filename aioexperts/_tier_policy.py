"""Which of a layer step's misses read the low-precision miss tier (:class:`~aioexperts.MissTier`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._options import MissTier
from ._router import Routing

__all__ = ("low_tier_misses",)


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
