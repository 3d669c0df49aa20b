"""deepseek (DeepSeek-V1 MoE): llama.cpp src/models/deepseek.cpp."""

from aioexperts._format.archs._base import (
    Architecture,
    GatingFunc,
    MoERule,
    Status,
    shared_count_x_width,
    width_required,
)

_SOFTMAX = GatingFunc.SOFTMAX

ARCHS = (
    Architecture(
        "deepseek",
        # deepseek.cpp: SOFTMAX, norm_w=false, scale_w=false; leading dense blocks; count x n_ff_exp shared
        moe=MoERule(
            Status.SOURCE,
            _SOFTMAX,
            _SOFTMAX,
            False,
            False,
            False,
            width_required,
            shared_count_x_width,
            dense_lead=True,
        ),
    ),
)
