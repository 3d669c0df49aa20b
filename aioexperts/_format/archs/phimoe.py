"""phimoe: llama.cpp src/models/phi3.cpp (its MoE branch)."""

from aioexperts._format.archs._base import Architecture, GatingFunc, MoERule, Status, no_shared, width_is_ff

_SOFTMAX = GatingFunc.SOFTMAX

ARCHS = (
    Architecture(
        "phimoe",
        # phi3.cpp MoE branch (phimoe): SOFTMAX, norm_w=true; the loader reads no scale
        moe=MoERule(Status.SOURCE, _SOFTMAX, _SOFTMAX, True, True, False, width_is_ff, no_shared),
    ),
)
