"""hunyuan-moe: llama.cpp src/models/hunyuan-moe.cpp."""

from aioexperts._format.archs._base import (
    Architecture,
    GatingFunc,
    MoERule,
    Status,
    one_shared_key_or_ff,
    width_is_ff,
)

_SOFTMAX = GatingFunc.SOFTMAX

ARCHS = (
    Architecture(
        "hunyuan-moe",
        # hunyuan-moe.cpp: SOFTMAX, norm_w=true, experts n_ff wide; an ungated shared "mlp" in every layer,
        # n_ff_shexp = key or n_ff; the loader reads no scale
        moe=MoERule(Status.SOURCE, _SOFTMAX, _SOFTMAX, True, True, False, width_is_ff, one_shared_key_or_ff),
    ),
)
