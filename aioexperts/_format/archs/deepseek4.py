"""deepseek4 (DeepSeek-V4): llama.cpp src/models/deepseek4.cpp (``load_arch_hparams`` and graph)."""

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
        "deepseek4",
        # deepseek4.cpp load_arch_hparams + graph: gating key required and must be sqrtsoftplus, norm and scale
        # keys required, exp_probs_b, per-block expert widths and SwiGLU clamps (ggml_swiglu_clamp), an ungated
        # shared expert n_ff_exp * expert_shared_count wide, the first hash_layer_count blocks routed by token id
        moe=MoERule(
            Status.SOURCE,
            None,
            None,
            None,
            False,
            True,
            width_required,
            shared_count_x_width,
            only_gating=GatingFunc.SQRT_SOFTPLUS,
            required=("expert_weights_norm", "expert_weights_scale", "expert_shared_count", "hash_layer_count"),
            ff_exp_array=True,
            clamps=True,
            hash_routing=True,
        ),
        # deepseek4.cpp: hyper-connections around every block (aioexperts/_compute/hyper.py), the compressed
        # attention block "dsv4" (aioexperts/_model/dsv4_block.py), NORM RoPE on the heads' last dims
        model=ArchitectureRecord("deepseek4", RopeType.NORM, "deepseek4.cpp", block="dsv4", hyper_connections=True),
    ),
)
