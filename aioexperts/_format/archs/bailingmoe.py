"""bailingmoe, bailingmoe2: llama.cpp src/models/bailingmoe.cpp and bailingmoe2.cpp."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aioexperts._errors import FormatError
from aioexperts._format.archs._base import (
    Architecture,
    GatingFunc,
    MoERule,
    Status,
    shared_count_x_width,
    width_required,
)

if TYPE_CHECKING:
    from aioexperts._format.keys import ArchKeys, ExpertCounts


def _shared_key_or_width_x_count(
    md: ArchKeys, counts: ExpertCounts, n_ff_exp: int, n_shared: int, n_ff_shexp: int
) -> tuple[int, int]:
    """bailingmoe2.cpp ``load_tensors``: ``(n_ff_shexp ? n_ff_shexp : n_ff_exp) * n_expert_shared``,
    ``expert_shared_count`` required."""
    if not md.has("expert_shared_count"):
        raise FormatError(f"missing required key {md.key('expert_shared_count')}")
    return n_shared, (n_ff_shexp or n_ff_exp) * n_shared


ARCHS = (
    Architecture(
        "bailingmoe",
        # bailingmoe.cpp: SOFTMAX, norm key, scale key; every block is MoE in the graph
        moe=MoERule(
            Status.SOURCE,
            GatingFunc.SOFTMAX,
            GatingFunc.SOFTMAX,
            None,
            False,
            True,
            width_required,
            shared_count_x_width,
        ),
    ),
    Architecture(
        "bailingmoe2",
        # bailingmoe2.cpp: gating key (required), norm key, scale key, optional exp_probs_b, leading dense
        # blocks, NextN blocks, (n_ff_shexp or n_ff_exp) x expert_shared_count shared
        moe=MoERule(
            Status.SOURCE,
            None,
            None,
            None,
            False,
            True,
            width_required,
            _shared_key_or_width_x_count,
            dense_lead=True,
        ),
    ),
)
