"""qwen3next: llama.cpp src/models/qwen3next.cpp (``build_layer_ffn``)."""

from aioexperts._format.archs._base import (
    Architecture,
    GatingFunc,
    MoERule,
    Status,
    shared_if_key,
    width_or_ff_over_used,
)

_SOFTMAX = GatingFunc.SOFTMAX

ARCHS = (
    Architecture(
        "qwen3next",
        # qwen3next.cpp build_layer_ffn: SOFTMAX, norm_w=true; sigmoid-gated shared expert (n_ff_shexp key)
        moe=MoERule(Status.SOURCE, _SOFTMAX, _SOFTMAX, True, True, False, width_or_ff_over_used, shared_if_key),
    ),
)
