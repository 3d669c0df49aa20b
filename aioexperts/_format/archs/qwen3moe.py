"""qwen3moe, qwen3vlmoe: llama.cpp src/models/qwen3moe.cpp and qwen3vl-moe.cpp, src/llama-model.cpp (RoPE type)."""

from aioexperts._format.archs._base import (
    Architecture,
    ArchitectureRecord,
    GatingFunc,
    MoERule,
    RopeType,
    Status,
    no_shared,
    width_or_ff_over_used,
)

_SOFTMAX = GatingFunc.SOFTMAX

ARCHS = (
    Architecture(
        "qwen3moe",
        # qwen3moe.cpp: SOFTMAX, norm_w=true, no shared expert
        moe=MoERule(Status.GOLDEN, _SOFTMAX, _SOFTMAX, True, True, False, width_or_ff_over_used, no_shared),
        # qwen3moe.cpp: per-head q/k RMSNorm before RoPE, NEOX, scale 1/sqrt(head)
        model=ArchitectureRecord(
            "qwen3moe", RopeType.NEOX, "qwen3moe.cpp", qk_norm="head", qk_norm_required=True, rot_equals_head=True
        ),
    ),
    Architecture(
        "qwen3vlmoe",
        # qwen3vl-moe.cpp: as qwen3moe.cpp
        moe=MoERule(Status.SOURCE, _SOFTMAX, _SOFTMAX, True, True, False, width_or_ff_over_used, no_shared),
    ),
)
