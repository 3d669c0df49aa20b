"""grok: llama.cpp src/models/grok.cpp."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aioexperts._errors import FormatError
from aioexperts._format.archs._base import Activation, Architecture, GatingFunc, MoERule, Status, no_shared

if TYPE_CHECKING:
    from aioexperts._format.keys import ArchKeys, ExpertCounts


def _width_or_ff(md: ArchKeys, counts: ExpertCounts, n_ff_exp: int) -> int:
    """grok.cpp ``load_tensors``: ``n_ff_exp ? n_ff_exp : n_ff``."""
    if n_ff_exp > 0:
        return n_ff_exp
    if counts.n_ff <= 0:
        raise FormatError(
            f"missing required key {md.key('expert_feed_forward_length')} "
            f"(and no {md.key('feed_forward_length')} to fall back on)"
        )
    return counts.n_ff


ARCHS = (
    Architecture(
        "grok",
        # grok.cpp: SOFTMAX, norm_w=true, GELU experts; the loader reads no scale. Grok-2's parallel dense
        # FFN (ffn_up/gate/down) is refused by MoEHParams.check_tensors
        moe=MoERule(
            Status.SOURCE,
            GatingFunc.SOFTMAX,
            GatingFunc.SOFTMAX,
            True,
            True,
            False,
            _width_or_ff,
            no_shared,
            Activation.GELU,
            parallel_dense_ffn=True,
        ),
    ),
)
