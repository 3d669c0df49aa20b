"""qwen35moe: llama.cpp src/models/qwen35moe.cpp (``build_layer_ffn``, ``load_arch_hparams``)."""

from aioexperts._format.archs._base import (
    Architecture,
    GatingFunc,
    MoERule,
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
        whole_model_missing="Qwen3.5-MoE's gated delta net linear attention (ssm_*, attn_qkv/attn_gate) and gated "
        "full attention are not implemented; its MoE layers run through aioexperts.open() and MoERunner",
    ),
)
