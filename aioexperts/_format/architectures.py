"""Whole-model hyper-parameters: one record per architecture, read the way llama.cpp reads them.

:data:`ARCHITECTURES` maps each architecture the whole-model forward pass runs to an
:class:`ArchitectureRecord`: the rules that are fixed by llama.cpp's source for that arch (its RoPE
pairing in ``llama_model_rope_type``, the keys its ``load_arch_hparams`` reads, the tensors its graph
in ``src/models/<arch>.cpp`` uses). :func:`model_hparams` resolves a parsed GGUF file into a frozen
:class:`ModelHParams` with the generic keys of ``llama_model::load_hparams`` (``src/llama-model.cpp``)
and the RoPE context parameters of ``llama_context``'s constructor (``src/llama-context.cpp``).

The MoE routing rules stay in :mod:`aioexperts._format.hparams` (:class:`MoEHParams`); a
:class:`ModelHParams` carries the resolved :class:`MoEHParams` as ``moe``.

A new architecture plugs in with :func:`register_architecture` (see ``aioexperts/_model/__init__.py``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.header import SkippedValue
from aioexperts._format.hparams import WHOLE_MODEL_MISSING, MoEHParams, _Meta
from aioexperts._format.model import GGUFModel

__all__ = (
    "ARCHITECTURES",
    "ArchitectureRecord",
    "ModelHParams",
    "RopeParams",
    "RopeScaling",
    "RopeType",
    "model_hparams",
    "register_architecture",
)


class RopeType(enum.IntEnum):
    """How RoPE pairs the head's dimensions (llama.cpp ``llama_rope_type``, ``llama_model_rope_type``)."""

    NORM = 0
    """Adjacent pairs ``(2i, 2i+1)`` (``GGML_ROPE_TYPE_NORMAL``)."""
    NEOX = 2
    """Halves ``(i, i + n_rot/2)`` (``GGML_ROPE_TYPE_NEOX``)."""


class RopeScaling(enum.StrEnum):
    """``{arch}.rope.scaling.type`` (llama-model.cpp ``LLAMA_ROPE_SCALING_TYPES``); ``linear`` when absent."""

    NONE = "none"
    LINEAR = "linear"
    YARN = "yarn"


@dataclass(frozen=True, slots=True)
class RopeParams:
    """The arguments of ``ggml_rope_ext`` for one layer, resolved as ``llama_context`` resolves them.

    Attributes:
        rope_type: pairing (:class:`RopeType`).
        n_rot: rotated dimensions per head (``rope.dimension_count``, default the head size); the
            rest of the head passes through.
        freq_base: ``rope.freq_base`` (10000 when absent).
        freq_scale: ``1 / rope.scaling.factor`` (1 when absent or 0, or scaling ``none``).
        ext_factor: YaRN extrapolation mix: 1 for YaRN scaling, else 0.
        attn_factor: the magnitude factor (``cparams.yarn_attn_factor``: YaRN's ``mscale`` correction
            times ``rope.scaling.attn_factor``).
        beta_fast, beta_slow: YaRN's correction range (32 and 1).
        n_ctx_orig: ``rope.scaling.original_context_length`` (default ``context_length``).
    """

    rope_type: RopeType
    n_rot: int
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0


@dataclass(frozen=True, slots=True)
class ArchitectureRecord:
    """What llama.cpp's source fixes for one architecture (the rest comes from the file).

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
    status: str = "golden"


#: The architectures the whole-model forward pass runs, by ``general.architecture``.
ARCHITECTURES: dict[str, ArchitectureRecord] = {}


def register_architecture(record: ArchitectureRecord) -> ArchitectureRecord:
    """Add (or replace) ``record`` in :data:`ARCHITECTURES`; returns it."""
    ARCHITECTURES[record.name] = record
    return record


_NORM, _NEOX = RopeType.NORM, RopeType.NEOX
for _record in (
    # qwen3moe.cpp: per-head q/k RMSNorm before RoPE, NEOX, scale 1/sqrt(head)
    ArchitectureRecord("qwen3moe", _NEOX, "qwen3moe.cpp", qk_norm="head", qk_norm_required=True, rot_equals_head=True),
    # qwen2moe.cpp: q/k/v biases (optional in build_qkv), NEOX
    ArchitectureRecord("qwen2moe", _NEOX, "qwen2moe.cpp", rot_equals_head=True),
    # glm4-moe.cpp: optional per-head q/k norms, partial rotary (rope.dimension_count), NEOX,
    # post_attention_norm feeds the FFN, leading dense blocks
    ArchitectureRecord(
        "glm4moe", _NEOX, "glm4-moe.cpp", ffn_norm="post_attention_norm", qk_norm="head", dense_lead=True
    ),
    # llama.cpp (the Mixtral branch, n_expert > 0): NORM pairs, n_rot == head size
    ArchitectureRecord("llama", _NORM, "llama.cpp", rot_equals_head=True, rope_freqs=True),
    # olmoe.cpp: RMSNorm over the whole q and k projections, NEOX
    ArchitectureRecord("olmoe", _NEOX, "olmoe.cpp", qk_norm="whole", qk_norm_required=True, rot_equals_head=True),
    # granite.cpp (granitemoe): the four scalars, NORM
    ArchitectureRecord("granitemoe", _NORM, "granite.cpp", granite_scalars=True, rot_equals_head=True, rope_freqs=True),
    # openai-moe.cpp (gpt-oss): biases, sinks, sliding window on every other layer (pattern 2), NEOX,
    # post_attention_norm feeds the MoE
    ArchitectureRecord(
        "gpt-oss", _NEOX, "openai-moe.cpp", ffn_norm="post_attention_norm", sliding_window_pattern=2, sinks=True
    ),
    # deepseek2.cpp (DeepSeek-V2/V3): MLA attention (block "mla", aioexperts/_model/mla_block.py), NORM,
    # leading dense blocks
    ArchitectureRecord("deepseek2", _NORM, "deepseek2.cpp", dense_lead=True, block="mla", yarn_log_multiplier=True),
):
    register_architecture(_record)
del _record


@dataclass(frozen=True, slots=True)
class ModelHParams:
    """The hyper-parameters of a whole model (attention, RoPE, norms, vocabulary) plus its MoE ones.

    Attributes:
        arch: ``general.architecture``.
        record: the architecture's :class:`ArchitectureRecord`.
        moe: the MoE routing parameters (:class:`MoEHParams`).
        n_layer: blocks run (``block_count`` minus ``nextn_predict_layers``).
        n_embd: ``embedding_length``.
        n_head, n_head_kv: ``attention.head_count`` and ``attention.head_count_kv`` (default n_head).
        head_k, head_v: ``attention.key_length`` / ``value_length`` (default ``n_embd / n_head``).
        rope: :class:`RopeParams` of the full-attention layers.
        rope_swa: :class:`RopeParams` of the sliding-window layers (``rope.freq_base_swa``).
        norm_eps: ``attention.layer_norm_rms_epsilon``.
        n_ctx_train: ``context_length``.
        n_swa: ``attention.sliding_window`` (0: none).
        swa_layers: per block, whether it uses the sliding window.
        embedding_scale, residual_scale, attention_scale, logit_scale: Granite's scalars (0 or 1:
            not applied; ``attention_scale`` 0 means ``1/sqrt(head_k)``).
        n_dense_lead: leading dense blocks.
        n_vocab: rows of ``token_embd.weight``.
        eog_ids: ids that end a generation (``tokenizer.ggml.eos/eot/eom_token_id`` present and in range).
        yarn_log_mul: ``rope.scaling.yarn_log_multiplier`` (deepseek2 reads it), 0 when absent.
        metadata: the arch-prefixed keys the record's block may want (``{name: value}`` without the prefix).
    """

    arch: str
    record: ArchitectureRecord
    moe: MoEHParams
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_k: int
    head_v: int
    rope: RopeParams
    rope_swa: RopeParams
    norm_eps: float
    n_ctx_train: int
    n_swa: int
    swa_layers: tuple[bool, ...]
    embedding_scale: float
    residual_scale: float
    attention_scale: float
    logit_scale: float
    n_dense_lead: int
    n_vocab: int
    eog_ids: frozenset[int]
    yarn_log_mul: float = 0.0
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def rope_for(self, layer: int) -> RopeParams:
        """The RoPE parameters of block ``layer`` (llama-model.cpp ``get_rope_freq_base/scale``)."""
        return self.rope_swa if self.swa_layers[layer] else self.rope

    def window(self, layer: int) -> int:
        """The sliding window of block ``layer`` in positions, 0 for full attention."""
        return self.n_swa if self.swa_layers[layer] else 0


def _scaling(md: _Meta) -> RopeScaling:
    raw = md.md.get(md.key("rope.scaling.type"))
    if raw is None:
        return RopeScaling.LINEAR
    if not isinstance(raw, str):
        raise FormatError(f"{md.key('rope.scaling.type')} must be a string, got {raw!r}")
    try:
        return RopeScaling(raw)
    except ValueError:
        raise UnsupportedTypeError(
            f"{md.key('rope.scaling.type')}={raw!r} is not supported (none, linear, yarn; longrope needs "
            "per-dimension factors this forward pass does not apply)"
        ) from None


def _rope_params(
    md: _Meta, rope_type: RopeType, n_rot: int, freq_base: float, n_ctx_train: int, yarn_log_mul: float
) -> RopeParams:
    """llama-model.cpp ``load_hparams`` (scaling keys) + llama-context.cpp constructor (YaRN factors)."""
    scaling = _scaling(md)
    factor = md.float_("rope.scaling.factor", 0.0)
    if factor == 0.0:
        factor = md.float_("rope.scale_linear", 0.0)
    if factor < 0 or not math.isfinite(factor):
        raise FormatError(f"{md.key('rope.scaling.factor')} must be >= 0, got {factor}")
    freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    if scaling == RopeScaling.NONE:
        freq_scale = 1.0
    rope_attn_factor = md.float_("rope.scaling.attn_factor", 1.0)
    n_ctx_orig = md.int_("rope.scaling.original_context_length", default=n_ctx_train) or n_ctx_train
    ext_factor = 1.0 if scaling == RopeScaling.YARN else 0.0
    attn_factor = 1.0
    if ext_factor != 0.0:

        def get_mscale(scale: float, mscale: float) -> float:
            return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0

        f = 1.0 / freq_scale
        if yarn_log_mul != 0.0:
            mscale = yarn_log_mul if yarn_log_mul != 1.0 else 1.0  # only records with yarn_log_multiplier
            attn_factor = get_mscale(f, mscale) / get_mscale(f, yarn_log_mul)
        else:
            attn_factor = get_mscale(f, 1.0)
        attn_factor *= 1.0 / (1.0 + 0.1 * math.log(f))  # cancelled again inside ggml's rope_yarn
    attn_factor *= rope_attn_factor
    return RopeParams(
        rope_type=rope_type,
        n_rot=n_rot,
        freq_base=freq_base,
        freq_scale=freq_scale,
        ext_factor=ext_factor,
        attn_factor=attn_factor,
        n_ctx_orig=n_ctx_orig,
    )


def _eog_ids(metadata: Mapping[str, Any], n_vocab: int) -> frozenset[int]:
    ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= int(value) < n_vocab:
            ids.add(int(value))
    return frozenset(ids)


def model_hparams(model: GGUFModel) -> ModelHParams:
    """Resolve the whole-model hyper-parameters of a parsed GGUF file.

    Args:
        model: a parsed model (:func:`aioexperts.open_model`).

    Returns:
        The frozen :class:`ModelHParams`.

    Raises:
        UnsupportedTypeError: the architecture has no record in :data:`ARCHITECTURES` (the message
            names it and lists the supported ones), a per-layer array where one value is supported,
            an unsupported RoPE scaling type or M-RoPE sections.
        FormatError: a required key or tensor is missing (``token_embd.weight``), a value is out of
            range or inconsistent (head counts that do not divide, ``n_rot`` larger than the head).
    """
    arch = model.architecture
    record = _record_of(arch)
    md = _Meta(arch, model.metadata)
    moe = MoEHParams.from_metadata(arch, model.metadata)
    n_embd = moe.n_embd
    n_layer = moe.n_layer - moe.n_layer_nextn
    if n_layer <= 0:
        raise FormatError(f"{md.key('block_count')} is missing or 0: the model has no blocks")
    n_head, n_head_kv, head_k, head_v = _heads(md, n_embd)
    n_rot = _rotary_dims(md, record, head_k)
    norm_eps = md.float_("attention.layer_norm_rms_epsilon", -1.0)
    if norm_eps < 0:
        raise FormatError(f"missing required key {md.key('attention.layer_norm_rms_epsilon')}")
    n_ctx_train = md.int_("context_length", required=True)
    if n_ctx_train <= 0:
        raise FormatError(f"{md.key('context_length')} must be > 0, got {n_ctx_train}")
    freq_base = md.float_("rope.freq_base", 10000.0)
    if not freq_base > 0:
        raise FormatError(f"{md.key('rope.freq_base')} must be > 0, got {freq_base}")
    yarn_log_mul = md.float_("rope.scaling.yarn_log_multiplier", 0.0) if record.yarn_log_multiplier else 0.0
    rope = _rope_params(md, record.rope_type, n_rot, freq_base, n_ctx_train, yarn_log_mul)
    n_swa, swa_layers, rope_swa = _sliding_window(md, record, rope, n_layer)
    embedding_scale, residual_scale, attention_scale, logit_scale = _granite_scalars(md, record)
    n_vocab = _n_vocab(model, n_embd)
    extra = {
        k[len(arch) + 1 :]: v
        for k, v in model.metadata.items()
        if k.startswith(arch + ".") and not isinstance(v, SkippedValue)
    }
    return ModelHParams(
        arch=arch,
        record=record,
        moe=moe,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_k=head_k,
        head_v=head_v,
        rope=rope,
        rope_swa=rope_swa,
        norm_eps=norm_eps,
        n_ctx_train=n_ctx_train,
        n_swa=n_swa,
        swa_layers=swa_layers,
        embedding_scale=embedding_scale,
        residual_scale=residual_scale,
        attention_scale=attention_scale,
        logit_scale=logit_scale,
        n_dense_lead=moe.n_layer_dense_lead if record.dense_lead else 0,
        n_vocab=n_vocab,
        eog_ids=_eog_ids(model.metadata, n_vocab),
        yarn_log_mul=yarn_log_mul,
        metadata=extra,
    )


def _record_of(arch: str) -> ArchitectureRecord:
    """The record of ``arch``, or UnsupportedTypeError naming what the whole model lacks for it."""
    record = ARCHITECTURES.get(arch)
    if record is None:
        missing = WHOLE_MODEL_MISSING.get(arch)
        raise UnsupportedTypeError(
            f"architecture {arch!r}: the whole-model forward pass is not implemented for it"
            + (f": {missing}" if missing else "")
            + f" (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return record


def _heads(md: _Meta, n_embd: int) -> tuple[int, int, int, int]:
    """``(n_head, n_head_kv, head_k, head_v)`` as llama-model.cpp ``load_hparams`` reads them."""
    n_head = md.int_("attention.head_count", required=True)
    n_head_kv = md.int_("attention.head_count_kv", default=n_head)
    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
        raise FormatError(
            f"{md.key('attention.head_count')}={n_head} and {md.key('attention.head_count_kv')}={n_head_kv}: "
            "both must be > 0 and the KV heads must divide the heads"
        )
    head_k = md.int_("attention.key_length", default=n_embd // n_head)
    head_v = md.int_("attention.value_length", default=n_embd // n_head)
    if head_k <= 0 or head_v <= 0:
        raise FormatError(f"head sizes must be > 0, got key_length={head_k}, value_length={head_v}")
    return n_head, n_head_kv, head_k, head_v


def _rotary_dims(md: _Meta, record: ArchitectureRecord, head_k: int) -> int:
    """``rope.dimension_count`` (default the head size), checked; M-RoPE sections are refused."""
    n_rot = md.int_("rope.dimension_count", default=head_k)
    if record.rot_equals_head and n_rot != head_k:
        raise FormatError(
            f"{md.key('rope.dimension_count')}={n_rot} must equal the head size {head_k} for {record.name}"
        )
    if record.block == "gqa" and not (0 < n_rot <= head_k and n_rot % 2 == 0):
        raise FormatError(f"{md.key('rope.dimension_count')}={n_rot} must be even and in 1..{head_k}")
    sections = md.md.get(md.key("rope.dimension_sections"))
    if isinstance(sections, list | tuple | SkippedValue) and any(
        isinstance(s, int) and s > 0 for s in (sections if isinstance(sections, list | tuple) else [1])
    ):
        raise UnsupportedTypeError(
            f"{md.key('rope.dimension_sections')}: M-RoPE (multimodal positions) is not supported"
        )
    return n_rot


def _sliding_window(
    md: _Meta, record: ArchitectureRecord, rope: RopeParams, n_layer: int
) -> tuple[int, tuple[bool, ...], RopeParams]:
    """``(n_swa, per-block sliding window, RoPE of those blocks)`` (llama-hparams.cpp ``set_swa_pattern``)."""
    if not record.sliding_window_pattern:
        return 0, (False,) * n_layer, rope
    n_swa = md.int_("attention.sliding_window", required=True)
    if n_swa <= 0:
        raise FormatError(f"{md.key('attention.sliding_window')} must be > 0, got {n_swa}")
    pattern = md.int_("attention.sliding_window_pattern", default=record.sliding_window_pattern)
    swa_layers = tuple(pattern == 0 or (il % pattern < pattern - 1) for il in range(n_layer))
    base_swa = md.float_("rope.freq_base_swa", rope.freq_base)
    return n_swa, swa_layers, dataclasses.replace(rope, freq_base=base_swa)


def _granite_scalars(md: _Meta, record: ArchitectureRecord) -> tuple[float, float, float, float]:
    """``(embedding_scale, residual_scale, attention.scale, logit_scale)`` for granite.cpp, else zeros."""
    if not record.granite_scalars:
        return 0.0, 0.0, 0.0, 0.0
    logit_scale = md.float_("logit_scale", 0.0)
    if logit_scale == 0.0:
        raise FormatError(f"missing required key {md.key('logit_scale')} (granite-moe.cpp reads it)")
    return (
        md.float_("embedding_scale", 0.0),
        md.float_("residual_scale", 0.0),
        md.float_("attention.scale", 0.0),
        logit_scale,
    )


def _n_vocab(model: GGUFModel, n_embd: int) -> int:
    """The rows of ``token_embd.weight`` (ggml dims ``[n_embd, n_vocab]``)."""
    tok = model.tensors.get("token_embd.weight")
    if tok is None:
        raise FormatError(f"{model.path}: tensor 'token_embd.weight' is missing: no token embeddings")
    if len(tok.dims) != 2 or tok.dims[0] != n_embd:
        raise FormatError(f"token_embd.weight has dims {list(tok.dims)}, expected [{n_embd}, n_vocab]")
    return int(tok.dims[1])
