"""Whole-model hyper-parameters, read the way llama.cpp reads them.

Each architecture the whole-model forward pass runs has an :class:`ArchitectureRecord` in its entry
of the registry :mod:`aioexperts._format.archs` (``archs.MODEL_RECORDS``): the rules that are fixed
by llama.cpp's source for that arch (its RoPE pairing in ``llama_model_rope_type``, the keys its
``load_arch_hparams`` reads, the tensors its graph in ``src/models/<arch>.cpp`` uses), beside the
arch's MoE rules. :func:`model_hparams` resolves a parsed GGUF file into a frozen
:class:`ModelHParams` with the generic keys of ``llama_model::load_hparams`` (``src/llama-model.cpp``)
and the RoPE context parameters of ``llama_context``'s constructor (``src/llama-context.cpp``).

The MoE routing is resolved by :mod:`aioexperts._format.hparams` (:class:`MoEHParams`); a
:class:`ModelHParams` carries the resolved :class:`MoEHParams` as ``moe``.

A new architecture plugs in with a module of :mod:`aioexperts._format.archs`, or with
``archs.register_architecture`` (see ``aioexperts/_model/__init__.py``).
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
from aioexperts._format.archs import MODEL_RECORDS, WHOLE_MODEL_MISSING
from aioexperts._format.archs._base import ArchitectureRecord, RopeType
from aioexperts._format.header import SkippedValue
from aioexperts._format.hparams import MoEHParams
from aioexperts._format.keys import ArchKeys, refuse_a_sidecar
from aioexperts._format.model import GGUFModel

__all__ = (
    "ArchitectureRecord",
    "ModelHParams",
    "RopeParams",
    "RopeScaling",
    "RopeType",
    "model_hparams",
)


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


def _scaling(md: ArchKeys) -> RopeScaling:
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
    md: ArchKeys, rope_type: RopeType, n_rot: int, freq_base: float, n_ctx_train: int, yarn_log_mul: float
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
        UnsupportedTypeError: the architecture has no whole-model record (``archs.MODEL_RECORDS``; the message
            names it and lists the supported ones), a per-layer array where one value is supported,
            an unsupported RoPE scaling type or M-RoPE sections.
        FormatError: a required key or tensor is missing (``token_embd.weight``), a value is out of
            range or inconsistent (head counts that do not divide, ``n_rot`` larger than the head).
    """
    arch = model.architecture
    if arch not in MODEL_RECORDS:  # a sidecar given for its model: say so, not "not implemented"
        refuse_a_sidecar(model.path, arch, model.metadata)
    record = _record_of(arch)
    md = ArchKeys(arch, model.metadata)
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
    record = MODEL_RECORDS.get(arch)
    if record is None:
        missing = WHOLE_MODEL_MISSING.get(arch)
        raise UnsupportedTypeError(
            f"architecture {arch!r}: the whole-model forward pass is not implemented for it"
            + (f": {missing}" if missing else "")
            + f" (supported: {', '.join(sorted(MODEL_RECORDS))})"
        )
    return record


def _heads(md: ArchKeys, n_embd: int) -> tuple[int, int, int, int]:
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


def _rotary_dims(md: ArchKeys, record: ArchitectureRecord, head_k: int) -> int:
    """``rope.dimension_count`` (default the head size), checked; M-RoPE sections are refused (unless
    the record reads text positions through them, ``text_mrope``)."""
    n_rot = md.int_("rope.dimension_count", default=head_k)
    if record.rot_equals_head and n_rot != head_k:
        raise FormatError(
            f"{md.key('rope.dimension_count')}={n_rot} must equal the head size {head_k} for {record.name}"
        )
    if record.block == "gqa" and not (0 < n_rot <= head_k and n_rot % 2 == 0):
        raise FormatError(f"{md.key('rope.dimension_count')}={n_rot} must be even and in 1..{head_k}")
    sections = md.md.get(md.key("rope.dimension_sections"))
    if (
        not record.text_mrope
        and isinstance(sections, list | tuple | SkippedValue)
        and any(isinstance(s, int) and s > 0 for s in (sections if isinstance(sections, list | tuple) else [1]))
    ):
        raise UnsupportedTypeError(
            f"{md.key('rope.dimension_sections')}: M-RoPE (multimodal positions) is not supported"
        )
    return n_rot


def _sliding_window(
    md: ArchKeys, record: ArchitectureRecord, rope: RopeParams, n_layer: int
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


def _granite_scalars(md: ArchKeys, record: ArchitectureRecord) -> tuple[float, float, float, float]:
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
