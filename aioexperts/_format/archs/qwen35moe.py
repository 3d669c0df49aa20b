"""qwen35moe: llama.cpp src/models/qwen35moe.cpp (``load_arch_hparams``, ``build_layer_ffn``, graph),
src/llama-model.cpp (RoPE type: IMROPE)."""

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

_SOFTMAX = GatingFunc.SOFTMAX

ARCHS = (
    Architecture(
        "qwen35moe",
        # qwen35moe.cpp build_layer_ffn: SOFTMAX, norm_w=true, w_scale 0 (the loader reads no scale); a shared
        # expert gated by sigmoid(ffn_gate_inp_shexp . x), n_ff_shexp = key or n_ff; the per-expert and
        # per-tensor scales (*_exps.scale, *_shexp.scale) multiply the projections (build_lora_mm_id,
        # build_lora_mm); expert_feed_forward_length may be a per-block array (get_key_or_arr)
        moe=MoERule(
            Status.SOURCE,
            _SOFTMAX,
            _SOFTMAX,
            True,
            True,
            False,
            width_or_ff_over_used,
            one_shared_key_or_ff,
            ff_exp_array=True,
            expert_scales=True,
        ),
        # qwen35moe.cpp graph: gated delta net and gated full attention blocks (block "qwen35",
        # aioexperts/_model/qwen35_blocks.py), the FFN on post_attention_norm; IMRoPE, which is NEOX
        # for text tokens (every section has the token's position)
        model=ArchitectureRecord(
            "qwen35moe",
            RopeType.NEOX,
            "qwen35moe.cpp",
            ffn_norm="post_attention_norm",
            block="qwen35",
            text_mrope=True,
        ),
    ),
)
