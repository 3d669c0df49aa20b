"""The parts an architecture's entry is made of: the enums, the MoE rule, the whole-model record, the entry.

An architecture's module (``aioexperts/_format/archs/<arch>.py``) builds its :class:`Architecture`
from a :class:`MoERule` (what llama.cpp's ``load_arch_hparams`` and ``build_moe_ffn`` call site fix
for its MoE layers, read by :meth:`~aioexperts._format.hparams.MoEHParams.from_metadata`) and an
:class:`ArchitectureRecord` (what its graph in ``src/models/<arch>.cpp`` fixes for the whole model,
read by :func:`~aioexperts._format.architectures.model_hparams`). The rule functions that more than
one architecture follows are here, each naming the llama.cpp source it follows; a rule only one
architecture uses sits in that architecture's module.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aioexperts._errors import FormatError

if TYPE_CHECKING:
    from aioexperts._format.keys import ArchKeys, ExpertCounts

__all__ = (
    "Activation",
    "Architecture",
    "ArchitectureRecord",
    "ExpertWidthRule",
    "GatingFunc",
    "MoERule",
    "RopeType",
    "SharedRule",
    "Status",
)


class GatingFunc(enum.IntEnum):
    """``{arch}.expert_gating_func`` (llama.cpp ``llama_expert_gating_func_type``)."""

    SOFTMAX = 1
    """Probabilities are ``softmax(logits)`` over all experts."""
    SIGMOID = 2
    """Probabilities are ``sigmoid(logits)`` per expert (DeepSeek-V3, GLM-4.5)."""
    SOFTMAX_WEIGHT = 3
    """Select on the raw logits, then ``softmax`` over the k selected logits (gpt-oss)."""
    SQRT_SOFTPLUS = 4
    """Probabilities are ``sqrt(softplus(logits))`` per expert (DeepSeek-V4, ``sqrtsoftplus``)."""


class Activation(enum.StrEnum):
    """The gated activation of the routed experts (``type_op`` of llama.cpp's ``build_moe_ffn``)."""

    SILU = "silu"
    """SwiGLU (``LLM_FFN_SILU``, ``ggml_swiglu_split``): ``silu(gate) * up``."""
    SWIGLU_OAI = "swiglu_oai"
    """gpt-oss: ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``, ``g*sigmoid(alpha*g)*(u+1)``."""
    GELU = "gelu"
    """GeGLU (``LLM_FFN_GELU``, ``ggml_geglu_split``): ``gelu(gate) * up`` with ggml's tanh GELU
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (grok)."""


class Status(enum.StrEnum):
    """How far this library's reading of an architecture is checked (the table in docs/executor.md)."""

    GOLDEN = "golden"
    """Verified against tensors llama.cpp computed (the shared fixtures' goldens)."""
    SOURCE = "source"
    """Implemented from llama.cpp's source, tested against an independent float64 reference."""
    REFUSED = "refused"
    """Refused with :class:`~aioexperts._errors.UnsupportedTypeError` naming what is missing."""
    GENERIC = "generic"
    """Not an architecture llama.cpp knows: the generic rules, unverified (the runner warns)."""


class RopeType(enum.IntEnum):
    """How RoPE pairs the head's dimensions (llama.cpp ``llama_rope_type``, ``llama_model_rope_type``)."""

    NORM = 0
    """Adjacent pairs ``(2i, 2i+1)`` (``GGML_ROPE_TYPE_NORMAL``)."""
    NEOX = 2
    """Halves ``(i, i + n_rot/2)`` (``GGML_ROPE_TYPE_NEOX``)."""


# ----------------------------------------------------------------------------------------------
# the MoE rules an architecture's entry is made of: each follows one piece of llama.cpp's source.
# The generic keys (block_count, embedding_length, expert_count, ...) are read by
# llama_model_base::load_hparams (src/llama-model.cpp); everything per arch by the arch's
# load_arch_hparams and load_tensors (src/models/<arch>.cpp) and its build_moe_ffn call.

#: ``(keys, counts, expert width key) -> n_ff_exp``: the width of a routed expert (its gate/up rows).
ExpertWidthRule = Callable[["ArchKeys", "ExpertCounts", int], int]
#: ``(keys, counts, n_ff_exp, shared count key, shared width key) -> (n_shared, n_ff_shexp)``.
SharedRule = Callable[["ArchKeys", "ExpertCounts", int, int, int], tuple[int, int]]


def width_required(md: ArchKeys, counts: ExpertCounts, n_ff_exp: int) -> int:
    """deepseek*, glm4moe, gpt-oss, ernie, bailing*, dots1, llama4, minimax-m2: ``load_arch_hparams``
    reads ``expert_feed_forward_length`` with ``get_key_or_arr(..., required)``."""
    if n_ff_exp <= 0:
        raise FormatError(f"missing required key {md.key('expert_feed_forward_length')}")
    return n_ff_exp


def width_or_ff_over_used(md: ArchKeys, counts: ExpertCounts, n_ff_exp: int) -> int:
    """qwen2moe.cpp / qwen3moe.cpp ``load_tensors``: ``n_ff_exp ? n_ff_exp : n_ff / n_expert_used``."""
    if n_ff_exp > 0:
        return n_ff_exp
    if counts.n_ff <= 0:
        raise FormatError(
            f"missing required key {md.key('expert_feed_forward_length')} "
            f"(and no {md.key('feed_forward_length')} to derive it from)"
        )
    return counts.n_ff // counts.n_expert_used


def width_is_ff(md: ArchKeys, counts: ExpertCounts, n_ff_exp: int) -> int:
    """llama (Mixtral), olmoe, granite*, dbrx, phimoe, hunyuan-moe ``load_tensors``: the expert tensors
    are created ``n_ff`` wide; ``expert_feed_forward_length`` is not read."""
    if counts.n_ff <= 0:
        raise FormatError(f"missing required key {md.key('feed_forward_length')}")
    return counts.n_ff


def no_shared(md: ArchKeys, counts: ExpertCounts, n_ff_exp: int, n_shared: int, n_ff_shexp: int) -> tuple[int, int]:
    """No shared expert in the arch's graph (the keys are ignored, as llama.cpp ignores them)."""
    return 0, 0


def one_shared_key_or_ff(
    md: ArchKeys, counts: ExpertCounts, n_ff_exp: int, n_shared: int, n_ff_shexp: int
) -> tuple[int, int]:
    """qwen2moe.cpp / qwen35moe.cpp / hunyuan-moe.cpp ``load_tensors``: always one shared expert,
    ``n_ff_shexp ? n_ff_shexp : n_ff`` wide."""
    return 1, n_ff_shexp or counts.n_ff


def shared_if_key(md: ArchKeys, counts: ExpertCounts, n_ff_exp: int, n_shared: int, n_ff_shexp: int) -> tuple[int, int]:
    """qwen3next, granite*, ernie4_5-moe: one shared expert when ``expert_shared_feed_forward_length > 0``."""
    return (1 if n_ff_shexp > 0 else 0), n_ff_shexp


def shared_count_x_width(
    md: ArchKeys, counts: ExpertCounts, n_ff_exp: int, n_shared: int, n_ff_shexp: int
) -> tuple[int, int]:
    """deepseek*, glm4moe, bailingmoe, dots1 (deepseek2.cpp ``load_tensors``): ``expert_shared_count``
    is required and the shared experts are ``n_ff_exp * n_expert_shared`` wide."""
    if not md.has("expert_shared_count"):
        raise FormatError(f"missing required key {md.key('expert_shared_count')}")
    return n_shared, n_ff_exp * n_shared


@dataclass(frozen=True, slots=True)
class MoERule:
    """What llama.cpp's source fixes for one architecture's MoE layers (the rest comes from the file).

    Positional fields: status, gating, gating default, norm, norm default, read_scale, expert width
    rule, shared expert rule.
    """

    status: Status
    gating: GatingFunc | None  # fixed by the call site; None: read the key
    gating_default: GatingFunc | None  # key absent (or 0): this; None: llama.cpp aborts, so it is required
    norm: bool | None  # fixed; None: read the key
    norm_default: bool
    read_scale: bool  # False: the loader never reads expert_weights_scale, the call site gets 0
    expert_width: ExpertWidthRule
    shared: SharedRule
    activation: Activation = Activation.SILU
    dense_lead: bool = False  # the loader reads leading_dense_block_count and the graph honours it
    moe_step: bool = False  # interleave_moe_layer_step: block L is MoE iff (L + 1) % step == 0
    select_on_logits: bool = False  # llama4: top-k on the raw logits, weights from sigmoid(logits)
    weights_before_experts: bool = False  # llama4: weight_before_ffn
    only_gating: GatingFunc | None = None  # deepseek4: the loader refuses every other gating function
    required: tuple[str, ...] = ()  # keys the loader reads without a default (get_key(.., required))
    ff_exp_array: bool = False  # expert_feed_forward_length may be a per-block array (get_key_or_arr)
    clamps: bool = False  # deepseek4: per-block swiglu_clamp_exp / swiglu_clamp_shexp, ggml_swiglu_clamp
    hash_routing: bool = False  # deepseek4: hash_layer_count blocks route by token id (ffn_gate_tid2eid)
    expert_scales: bool = False  # qwen35moe: the graph applies ffn_*_exps.scale and ffn_*_shexp.scale
    #: without the gating key: ``(blocks run, vocabulary size) -> gating`` before ``gating_default``
    gating_when_absent: Callable[[int, int | None], GatingFunc | None] | None = None
    parallel_dense_ffn: bool = False  # grok: Grok-2's dense FFN beside the MoE (refused by check_tensors)


@dataclass(frozen=True, slots=True)
class ArchitectureRecord:
    """What llama.cpp's source fixes for one architecture's whole model (the rest comes from the file).

    Attributes:
        name: ``general.architecture``.
        rope_type: ``llama_model_rope_type`` (src/llama-model.cpp).
        graph: the llama.cpp graph file the block follows (``src/models/<file>``), for the docs.
        ffn_norm: the tensor that normalises the FFN/MoE input (``ffn_norm`` or, for gpt-oss and
            GLM-4-MoE, ``post_attention_norm``).
        qk_norm: ``"head"``: RMSNorm of each head of q and k (Qwen3, optional in GLM-4-MoE);
            ``"whole"``: RMSNorm over the whole q and k projections before the head split (OLMoE);
            ``None``: none.
        qk_norm_required: the norms must be present (Qwen3, OLMoE); otherwise used when present.
        granite_scalars: read ``embedding_scale``, ``residual_scale``, ``attention.scale`` and
            ``logit_scale`` (granite.cpp; ``logit_scale`` required, as granite-moe.cpp reads it).
        sliding_window_pattern: gpt-oss: ``attention.sliding_window`` is required and layers
            with ``il % n_pattern < n_pattern - 1`` use it (llama-hparams.cpp ``set_swa_pattern``);
            0: no sliding window.
        sinks: the attention reads ``blk.L.attn_sinks.weight`` (openai-moe.cpp).
        dense_lead: the leading ``leading_dense_block_count`` blocks run a dense SwiGLU FFN.
        rot_equals_head: ``rope.dimension_count`` must equal the head size (llama-model.cpp checks it
            for ``llama``; the qwen3moe/olmoe/granite graphs assert it).
        rope_freqs: the graph passes ``model.get_rope_factors`` to ``ggml_rope_ext``, so a
            ``rope_freqs.weight`` tensor divides each pair's frequency (llama.cpp, granite.cpp);
            elsewhere such a tensor is ignored, as llama.cpp ignores it.
        yarn_log_multiplier: the loader reads ``rope.scaling.yarn_log_multiplier`` and llama_context's
            YaRN magnitude takes it as ``mscale_all_dims`` (deepseek2.cpp ``load_arch_hparams``,
            llama-context.cpp ``[TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]``).
        block: name of the block implementation in :mod:`aioexperts._model.blocks` (``"gqa"``).
        hyper_connections: the residual is ``hyper_connection.count`` streams mixed around every block
            (deepseek4.cpp ``build_hc_pre`` / ``build_hc_post`` / ``build_hc_head``).
        text_mrope: the graph rotates with ``ggml_rope_multi`` and ``rope.dimension_sections``
            (qwen35moe.cpp's IMRoPE): for text tokens every section gets the token's position, which
            is NEOX on the first ``rope.dimension_count`` dims, so the sections are accepted.
        status: ``"golden"`` when checked against a llama.cpp ``forward.npz``.
    """

    name: str
    rope_type: RopeType
    graph: str
    ffn_norm: str = "ffn_norm"
    qk_norm: str | None = None
    qk_norm_required: bool = False
    granite_scalars: bool = False
    sliding_window_pattern: int = 0
    sinks: bool = False
    dense_lead: bool = False
    rot_equals_head: bool = False
    rope_freqs: bool = False
    yarn_log_multiplier: bool = False
    block: str = "gqa"
    hyper_connections: bool = False
    text_mrope: bool = False
    status: str = "golden"


@dataclass(frozen=True, slots=True)
class Architecture:
    """One architecture of the registry (:data:`aioexperts._format.archs.ARCHITECTURES`).

    Attributes:
        name: ``general.architecture``.
        moe: the rules of its MoE layers; None when they are refused (``refused`` says why) or when
            only a whole-model record was registered.
        model: its whole-model record; None when ``load()`` does not run it (``whole_model_missing``
            says what is missing, where known).
        refused: why its MoE layers are refused (the :class:`~aioexperts._errors.UnsupportedTypeError`
            message); empty when they are served.
        whole_model_missing: what the whole-model forward pass lacks for it (served MoE layers only).
    """

    name: str
    moe: MoERule | None = None
    model: ArchitectureRecord | None = None
    refused: str = ""
    whole_model_missing: str = ""

    def __post_init__(self) -> None:
        if self.model is not None and self.model.name != self.name:
            raise ValueError(f"the record of {self.name!r} is named {self.model.name!r}")
        if self.refused and self.moe is not None:
            raise ValueError(f"{self.name!r} has MoE rules and a refusal")

    @property
    def status(self) -> Status | None:
        """Its row status in docs/executor.md; None for an entry with neither MoE rules nor a refusal."""
        if self.refused:
            return Status.REFUSED
        return self.moe.status if self.moe is not None else None
