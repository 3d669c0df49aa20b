"""llama4: llama.cpp src/models/llama-iswa.cpp and the ``LLM_ARCH_LLAMA4`` branches of src/llama-graph.cpp
``build_moe_ffn``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aioexperts._format.archs._base import Architecture, GatingFunc, MoERule, Status, width_required

if TYPE_CHECKING:
    from aioexperts._format.keys import ArchKeys, ExpertCounts


def _one_shared_as_wide_as_routed(
    md: ArchKeys, counts: ExpertCounts, n_ff_exp: int, n_shared: int, n_ff_shexp: int
) -> tuple[int, int]:
    """llama4.cpp ``load_tensors``: one shared expert ``n_ff_exp`` wide."""
    return 1, n_ff_exp


ARCHS = (
    Architecture(
        "llama4",
        # llama4 (llama-iswa.cpp: SIGMOID, norm_w=false, w_scale 0, an ungated shared expert; build_moe_ffn's
        # LLM_ARCH_LLAMA4 branches: top-k on the raw logits, weights applied to the input before the
        # experts, weight_before_ffn); MoE every interleave_moe_layer_step blocks
        moe=MoERule(
            Status.SOURCE,
            GatingFunc.SIGMOID,
            GatingFunc.SIGMOID,
            False,
            False,
            False,
            width_required,
            _one_shared_as_wide_as_routed,
            moe_step=True,
            select_on_logits=True,
            weights_before_experts=True,
        ),
    ),
)
