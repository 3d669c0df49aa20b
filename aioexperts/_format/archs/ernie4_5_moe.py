"""ernie4_5-moe: llama.cpp src/models/ernie4-5-moe.cpp."""

from aioexperts._format.archs._base import Architecture, GatingFunc, MoERule, Status, shared_if_key, width_required

_SOFTMAX = GatingFunc.SOFTMAX

ARCHS = (
    Architecture(
        "ernie4_5-moe",
        # ernie4-5-moe.cpp: SOFTMAX, norm_w=true, exp_probs_b; MoE iff L >= n_layer_dense_lead and
        # (L + 1) % interleave_moe_layer_step == 0; ungated shared expert when n_ff_shexp > 0
        moe=MoERule(
            Status.SOURCE,
            _SOFTMAX,
            _SOFTMAX,
            True,
            True,
            False,
            width_required,
            shared_if_key,
            dense_lead=True,
            moe_step=True,
        ),
    ),
)
