"""dots1: llama.cpp src/models/dots1.cpp."""

from aioexperts._format.archs._base import Architecture, MoERule, Status, shared_count_x_width, width_required

ARCHS = (
    Architecture(
        "dots1",
        # dots1.cpp: gating key (required: 0 aborts in build_moe_ffn), norm key, scale key, exp_probs_b
        moe=MoERule(
            Status.SOURCE, None, None, None, False, True, width_required, shared_count_x_width, dense_lead=True
        ),
    ),
)
