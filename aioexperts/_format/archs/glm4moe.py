"""glm4moe (GLM-4.5): llama.cpp src/models/glm4-moe.cpp (``load_arch_hparams``, graph), src/llama-model.cpp."""

from aioexperts._format.archs._base import (
    Architecture,
    ArchitectureRecord,
    GatingFunc,
    MoERule,
    RopeType,
    Status,
    shared_count_x_width,
    width_required,
)

ARCHS = (
    Architecture(
        "glm4moe",
        # glm4-moe.cpp: gating key (sigmoid when absent), norm key, scale key, exp_probs_b, NextN blocks
        moe=MoERule(
            Status.GOLDEN,
            None,
            GatingFunc.SIGMOID,
            None,
            False,
            True,
            width_required,
            shared_count_x_width,
            dense_lead=True,
        ),
        # glm4-moe.cpp: optional per-head q/k norms, partial rotary (rope.dimension_count), NEOX,
        # post_attention_norm feeds the FFN, leading dense blocks
        model=ArchitectureRecord(
            "glm4moe", RopeType.NEOX, "glm4-moe.cpp", ffn_norm="post_attention_norm", qk_norm="head", dense_lead=True
        ),
    ),
)
