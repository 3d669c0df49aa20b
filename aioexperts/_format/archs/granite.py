"""granitemoe, granite: llama.cpp src/models/granite.cpp (``build_layer_ffn``), src/llama-model.cpp (RoPE type)."""

from aioexperts._format.archs._base import (
    Architecture,
    ArchitectureRecord,
    GatingFunc,
    MoERule,
    RopeType,
    Status,
    shared_if_key,
    width_is_ff,
)

_SOFTMAX = GatingFunc.SOFTMAX

# granite.cpp build_layer_ffn (granite, granitemoe): SOFTMAX, norm_w=true, w_scale 0; "Granite MoE
# Shared": an ungated shared expert when expert_shared_feed_forward_length > 0
ARCHS = (
    Architecture(
        "granitemoe",
        moe=MoERule(Status.GOLDEN, _SOFTMAX, _SOFTMAX, True, True, False, width_is_ff, shared_if_key),
        # granite.cpp (granitemoe): the four scalars, NORM
        model=ArchitectureRecord(
            "granitemoe", RopeType.NORM, "granite.cpp", granite_scalars=True, rot_equals_head=True, rope_freqs=True
        ),
    ),
    Architecture(
        "granite",
        moe=MoERule(Status.SOURCE, _SOFTMAX, _SOFTMAX, True, True, False, width_is_ff, shared_if_key),
    ),
)
