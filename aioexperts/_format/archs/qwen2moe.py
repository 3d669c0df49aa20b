"""qwen2moe: llama.cpp src/models/qwen2moe.cpp (graph and ``load_tensors``), src/llama-model.cpp (RoPE type)."""

from aioexperts._format.archs._base import (
    Architecture,
    ArchitectureRecord,
    GatingFunc,
    MoERule,
    RopeType,
    Status,
    one_shared_key_or_ff,
    width_or_ff_over_used,
)

ARCHS = (
    Architecture(
        "qwen2moe",
        # qwen2moe.cpp: SOFTMAX, norm_w=false; shared expert gated by sigmoid(ffn_gate_inp_shexp . x)
        moe=MoERule(
            Status.GOLDEN,
            GatingFunc.SOFTMAX,
            GatingFunc.SOFTMAX,
            False,
            False,
            False,
            width_or_ff_over_used,
            one_shared_key_or_ff,
        ),
        # qwen2moe.cpp: q/k/v biases (optional in build_qkv), NEOX
        model=ArchitectureRecord("qwen2moe", RopeType.NEOX, "qwen2moe.cpp", rot_equals_head=True),
    ),
)
