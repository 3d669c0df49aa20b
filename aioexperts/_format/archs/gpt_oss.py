"""gpt-oss: llama.cpp src/models/openai-moe-iswa.cpp, src/llama-model.cpp (RoPE type),
src/llama-hparams.cpp (``set_swa_pattern``)."""

from aioexperts._format.archs._base import (
    Activation,
    Architecture,
    ArchitectureRecord,
    GatingFunc,
    MoERule,
    RopeType,
    Status,
    no_shared,
    width_required,
)

_SOFTMAX_W = GatingFunc.SOFTMAX_WEIGHT

ARCHS = (
    Architecture(
        "gpt-oss",
        # openai-moe-iswa.cpp: SOFTMAX_WEIGHT, no norm, swiglu_oai, router and expert biases
        moe=MoERule(
            Status.GOLDEN,
            _SOFTMAX_W,
            _SOFTMAX_W,
            False,
            False,
            False,
            width_required,
            no_shared,
            Activation.SWIGLU_OAI,
        ),
        # openai-moe.cpp (gpt-oss): biases, sinks, sliding window on every other layer (pattern 2), NEOX,
        # post_attention_norm feeds the MoE
        model=ArchitectureRecord(
            "gpt-oss",
            RopeType.NEOX,
            "openai-moe.cpp",
            ffn_norm="post_attention_norm",
            sliding_window_pattern=2,
            sinks=True,
        ),
    ),
)
