"""dbrx: llama.cpp src/models/dbrx.cpp."""

from aioexperts._format.archs._base import Architecture, GatingFunc, MoERule, Status, no_shared, width_is_ff

_SOFTMAX = GatingFunc.SOFTMAX

ARCHS = (
    Architecture(
        "dbrx",
        # dbrx.cpp: SOFTMAX, norm_w=true; the loader reads no scale
        moe=MoERule(Status.SOURCE, _SOFTMAX, _SOFTMAX, True, True, False, width_is_ff, no_shared),
    ),
)
