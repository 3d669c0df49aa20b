"""deepseek2 (DeepSeek-V2/V3, GLM-4.7 Lite): llama.cpp src/models/deepseek2.cpp (``load_arch_hparams``,
graph), src/llama-model.cpp (RoPE type), src/llama-context.cpp (YaRN magnitude)."""

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

# deepseek2 without expert_gating_func: GLM-4.7 Lite (47 or 48 layers, vocabulary of 154880) is sigmoid.
_GLM47_LITE_LAYERS = (47, 48)
_GLM47_LITE_VOCAB = 154880


def _glm47_lite_is_sigmoid(n_layer: int, n_vocab: int | None) -> GatingFunc | None:
    """deepseek2.cpp ``load_arch_hparams``: without ``expert_gating_func``, GLM-4.7 Lite (47 or 48
    blocks run, a vocabulary of 154880) is sigmoid ("for compatibility with existing DeepSeek V2 and
    V2.5 GGUFs" every other file is softmax)."""
    return GatingFunc.SIGMOID if n_layer in _GLM47_LITE_LAYERS and n_vocab == _GLM47_LITE_VOCAB else None


ARCHS = (
    Architecture(
        "deepseek2",
        # deepseek2.cpp + loader: gating key (softmax when absent, GLM-4.7 Lite sigmoid), norm key, scale
        # key, exp_probs_b
        moe=MoERule(
            Status.GOLDEN,
            None,
            GatingFunc.SOFTMAX,
            None,
            False,
            True,
            width_required,
            shared_count_x_width,
            dense_lead=True,
            gating_when_absent=_glm47_lite_is_sigmoid,
        ),
        # deepseek2.cpp (DeepSeek-V2/V3): MLA attention (block "mla", aioexperts/_model/mla_block.py), NORM,
        # leading dense blocks
        model=ArchitectureRecord(
            "deepseek2", RopeType.NORM, "deepseek2.cpp", dense_lead=True, block="mla", yarn_log_multiplier=True
        ),
    ),
)
