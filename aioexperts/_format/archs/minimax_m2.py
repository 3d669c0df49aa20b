"""minimax-m2: llama.cpp src/models/minimax-m2.cpp."""

from aioexperts._format.archs._base import Architecture, MoERule, Status, no_shared, width_required

ARCHS = (
    Architecture(
        "minimax-m2",
        # minimax-m2.cpp: gating key (required), norm_w=true, exp_probs_b; the loader reads no scale
        moe=MoERule(Status.SOURCE, None, None, True, True, False, width_required, no_shared),
    ),
)
