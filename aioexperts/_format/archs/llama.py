"""llama (Mixtral): llama.cpp src/models/llama.cpp (the branch with ``n_expert > 0``), src/llama-model.cpp."""

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
        "llama",
        # llama.cpp (Mixtral branch when n_expert > 0): SOFTMAX, norm_w=true; the loader reads no scale
        moe=MoERule(Status.GOLDEN, _SOFTMAX, _SOFTMAX, True, True, False, width_is_ff, no_shared),
        # llama.cpp (the Mixtral branch, n_expert > 0): NORM pairs, n_rot == head size
        model=ArchitectureRecord("llama", RopeType.NORM, "llama.cpp", rot_equals_head=True, rope_freqs=True),
    ),
)
