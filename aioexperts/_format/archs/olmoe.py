"""olmoe: llama.cpp src/models/olmoe.cpp, src/llama-model.cpp (RoPE type)."""

from aioexperts._format.archs._base import (
    Architecture,
    ArchitectureRecord,
    GatingFunc,
    MoERule,
    RopeType,
    Status,
    no_shared,
    width_is_ff,
)

_SOFTMAX = GatingFunc.SOFTMAX

ARCHS = (
    Architecture(
        "olmoe",
        # olmoe.cpp: SOFTMAX, norm_w=false
        moe=MoERule(Status.GOLDEN, _SOFTMAX, _SOFTMAX, False, False, False, width_is_ff, no_shared),
        # olmoe.cpp: RMSNorm over the whole q and k projections, NEOX
        model=ArchitectureRecord(
            "olmoe", RopeType.NEOX, "olmoe.cpp", qk_norm="whole", qk_norm_required=True, rot_equals_head=True
        ),
    ),
)
