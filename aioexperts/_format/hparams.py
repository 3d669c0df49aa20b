"""MoE hyper-parameters of a GGUF model, resolved per architecture the way llama.cpp resolves them.

:meth:`MoEHParams.from_metadata` takes the architecture name (``general.architecture``) and a plain
mapping ``{key: python value}`` of the GGUF metadata (keys such as ``qwen3moe.expert_count``) and
returns a frozen :class:`MoEHParams`. The values that drive the routing (gating function, weight
normalisation, weight scale) are taken from the same place llama.cpp takes them: either the arch's
``build_moe_ffn`` call site hard-codes them (then the metadata key is *ignored*, exactly as llama.cpp
ignores it), or the arch's hparams loader reads the key (then the arch's default applies when the key
is missing; where llama.cpp has no default and would abort, the key is required).

The routing semantics themselves are llama.cpp's ``build_moe_ffn`` (src/llama-graph.cpp). The rules
of every architecture (:class:`~aioexperts._format.archs.MoERule`), with their llama.cpp source, are
in its module of the registry :mod:`aioexperts._format.archs`; docs/executor.md renders them as a
table with each arch's status (:class:`Status`): verified against a llama.cpp golden, implemented
from the source, or refused. Refused architectures (``archs.REFUSED``, and every other name in
``archs.LLAMA_CPP_ARCHS`` that has no rule) raise :class:`~aioexperts._errors.UnsupportedTypeError`
naming what is missing; a name llama.cpp does not know takes the generic rules (``verified`` is
False and the runner warns).

For every arch (llama-model.cpp ``load_hparams``): ``block_count``, ``embedding_length``,
``expert_count``, ``expert_used_count``, ``expert_group_count`` and ``expert_group_used_count`` are
read. A weight scale of 0 or 1 means "no scaling" (``build_moe_ffn`` applies it only when
``w_scale != 0 && w_scale != 1``); an arch whose loader never reads ``expert_weights_scale`` passes
0 whatever its call site says.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.archs import GENERIC, LLAMA_CPP_ARCHS, REFUSED, moe_rule
from aioexperts._format.archs._base import Activation, GatingFunc, MoERule, Status
from aioexperts._format.keys import ArchKeys, ExpertCounts

__all__ = (
    "Activation",
    "GatingFunc",
    "MoEHParams",
    "Status",
)

_SWIGLU_OAI_ALPHA = 1.702  # llama-graph.cpp build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE
_SWIGLU_OAI_LIMIT = 7.0


_SCALE_RE = re.compile(r"^blk\.\d+\.ffn_(?:gate|up|down|gate_up)_exps(?:_tier\d)?\.scale$")
_DENSE_UP_RE = re.compile(r"^blk\.(\d+)\.ffn_up\.weight$")
_APPLIED_SCALE_RE = re.compile(r"^blk\.\d+\.ffn_(?:gate|up|down)_exps\.scale$")  # qwen35moe: one per expert
_PROBS_B_VL_RE = re.compile(r"^blk\.\d+\.exp_probs_b_vl\.bias$")


@dataclass(frozen=True, slots=True)
class MoEHParams:
    """The MoE hyper-parameters of one model, as llama.cpp's ``build_moe_ffn`` sees them.

    Attributes:
        arch: ``general.architecture``.
        n_layer: ``block_count`` (0 when absent: unknown).
        n_embd: ``embedding_length``.
        n_expert: ``expert_count``: router outputs of a full layer (a pruned mixed-tier layer may
            have fewer, see docs/notes/FORMATS.md section 2).
        n_expert_used: ``expert_used_count``: k of top-k.
        n_ff_exp: a routed expert's hidden width (gate/up rows), 0 when the metadata does not say
            (generic archs only; the executor then takes it from the expert views).
        n_ff: ``feed_forward_length`` (dense FFN width), 0 when absent.
        n_expert_shared: number of shared experts (0: none).
        n_ff_shexp: the shared expert's hidden width (0: none, or unknown for generic archs).
        n_layer_dense_lead: ``leading_dense_block_count``: the first layers are dense, no experts.
        n_layer_nextn: ``nextn_predict_layers`` (MTP blocks counted in ``block_count``), 0 if absent.
        gating_func: how the router logits become probabilities.
        weights_norm: divide the k weights by their sum (clamped below at 6.103515625e-5).
        weights_scale: multiply the routed weights by this (1.0 when absent or 0).
        n_expert_groups: ``expert_group_count`` (0 or 1: no group-limited selection).
        n_group_used: ``expert_group_used_count``.
        activation: the routed experts' gated activation.
        swiglu_alpha: ``alpha`` of :attr:`Activation.SWIGLU_OAI` (1.702).
        swiglu_limit: ``limit`` of :attr:`Activation.SWIGLU_OAI` (7.0).
        n_moe_layer_step: ``interleave_moe_layer_step`` for the archs that read it (ernie4_5-moe,
            llama4): block ``L`` is MoE iff ``(L + 1) % step == 0``; 0 otherwise.
        select_on_logits: choose the top k on the raw router logits (llama4) instead of on the
            (biased) probabilities; the weights still come from the probabilities.
        weights_before_experts: multiply each selected expert's *input* by its routing weight and
            sum the expert outputs unweighted (llama.cpp ``weight_before_ffn``, llama4).
        n_ff_exp_layers: per-block expert widths when ``expert_feed_forward_length`` is an array
            (deepseek4, qwen35moe: ``get_key_or_arr``), one per block; empty when it is one value.
        swiglu_clamp_exp, swiglu_clamp_shexp: per-block SwiGLU limits of the routed and the shared
            experts (deepseek4: ``ggml_swiglu_clamp``, ``gate = min(gate, limit)``,
            ``up = clamp(up, -limit, limit)``); a limit of at most 1e-6 means no clamp; empty: none.
        n_hash_layers: ``hash_layer_count`` (deepseek4): blocks ``0..n_hash_layers-1`` choose their
            experts by token id from ``blk.L.ffn_gate_tid2eid.weight``, not by the router.
        expert_scales: the graph multiplies the projections by ``blk.L.ffn_{gate,up,down}_exps.scale``
            (one factor per expert) and ``blk.L.ffn_{gate,up,down}_shexp.scale`` (qwen35moe).
        verified: the arch has MoE rules in the registry (:mod:`aioexperts._format.archs`); False
            means the generic rules were applied (the runner logs a warning: results may differ
            from llama.cpp).
        status: the arch's row status in docs/executor.md (:class:`Status`); ``GENERIC`` for a
            name llama.cpp does not know.
    """

    arch: str
    n_layer: int
    n_embd: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int = 0
    n_expert_shared: int = 0
    n_ff_shexp: int = 0
    n_layer_dense_lead: int = 0
    n_layer_nextn: int = 0
    gating_func: GatingFunc = GatingFunc.SOFTMAX
    weights_norm: bool = False
    weights_scale: float = 1.0
    n_expert_groups: int = 0
    n_group_used: int = 0
    activation: Activation = Activation.SILU
    swiglu_alpha: float = _SWIGLU_OAI_ALPHA
    swiglu_limit: float = _SWIGLU_OAI_LIMIT
    n_moe_layer_step: int = 0
    select_on_logits: bool = False
    weights_before_experts: bool = False
    verified: bool = True
    status: Status = Status.SOURCE
    n_ff_exp_layers: tuple[int, ...] = ()
    swiglu_clamp_exp: tuple[float, ...] = ()
    swiglu_clamp_shexp: tuple[float, ...] = ()
    n_hash_layers: int = 0
    expert_scales: bool = False

    def expert_width(self, layer: int) -> int:
        """A routed expert's hidden width in block ``layer`` (``n_ff_exp`` unless given per block)."""
        if 0 <= layer < len(self.n_ff_exp_layers):
            return self.n_ff_exp_layers[layer]
        return self.n_ff_exp

    def expert_clamp(self, layer: int) -> float:
        """The routed experts' SwiGLU limit in block ``layer``; 0.0: no clamp (llama.cpp: limit <= 1e-6)."""
        return _clamp_at(self.swiglu_clamp_exp, layer)

    def shared_clamp(self, layer: int) -> float:
        """The shared expert's SwiGLU limit in block ``layer``; 0.0: no clamp."""
        return _clamp_at(self.swiglu_clamp_shexp, layer)

    def is_hash_layer(self, layer: int) -> bool:
        """Whether block ``layer`` picks its experts by token id (deepseek4 ``il < hash_layer_count``)."""
        return 0 <= layer < self.n_hash_layers

    @property
    def uses_groups(self) -> bool:
        """True when selection is group-limited (``n_expert_groups > 1``)."""
        return self.n_expert_groups > 1

    @property
    def has_shared_expert(self) -> bool:
        """True when the model declares shared experts (their tensors decide in the end)."""
        return self.n_expert_shared > 0 or self.n_ff_shexp > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has routed experts in llama.cpp's graph.

        Not one of the leading dense blocks (``leading_dense_block_count``), and for interleaved
        archs a block with ``(layer + 1) % n_moe_layer_step == 0`` (ernie4-5-moe.cpp, llama4).
        NextN / MTP blocks count as MoE blocks here (they have experts); :meth:`is_nextn_layer`
        tells them apart, and ``build_layout`` leaves them out.
        """
        if layer < 0 or (self.n_layer and layer >= self.n_layer):
            return False
        if self.n_moe_layer_step > 1 and (layer + 1) % self.n_moe_layer_step:
            return False
        return layer >= self.n_layer_dense_lead

    def is_nextn_layer(self, layer: int) -> bool:
        """Whether block ``layer`` is one of the last ``nextn_predict_layers`` (NextN / MTP) blocks."""
        return bool(self.n_layer_nextn and self.n_layer) and self.n_layer - self.n_layer_nextn <= layer < self.n_layer

    def check_tensors(self, names: Iterable[str]) -> None:
        """Refuse tensors whose effect on the MoE block this executor does not compute.

        Call it with every tensor name of the model before computing (``load_residents`` does).

        Args:
            names: the model's tensor names.

        Raises:
            UnsupportedTypeError: per-expert scales ``blk.L.ffn_{gate,up,down}_exps.scale``
                (llama-graph.cpp ``build_lora_mm_id`` multiplies each expert's output by them) of an
                arch whose graph does not pass them (all but qwen35moe), any of merged or tiered
                banks, the image-token routing bias ``blk.L.exp_probs_b_vl.bias``, or a
                grok model with a parallel dense FFN (``blk.L.ffn_up.weight`` in an MoE block,
                Grok-2: ``(dense + moe) * sqrt(2)/2`` in grok.cpp). The message names the tensor.
        """
        rule = moe_rule(self.arch)
        parallel_dense_ffn = rule is not None and rule.parallel_dense_ffn
        for name in names:
            m = _SCALE_RE.match(name)
            if m is not None and self.expert_scales and _APPLIED_SCALE_RE.match(name):
                continue  # qwen35moe: applied by the executor (ResidentLayer.*_exps_scale)
            if m is not None:
                raise UnsupportedTypeError(
                    f"tensor {name!r}: per-expert output scales (ffn_*_exps.scale) are not implemented; "
                    "llama.cpp multiplies each selected expert's projection by them"
                )
            if _PROBS_B_VL_RE.match(name):
                raise UnsupportedTypeError(
                    f"tensor {name!r}: the routing bias for image tokens (exp_probs_b_vl, DeepSeek-V4 vision) "
                    "needs media input, which this executor does not take"
                )
            if parallel_dense_ffn:
                m = _DENSE_UP_RE.match(name)
                if m is not None and self.is_moe_layer(int(m[1])):
                    raise UnsupportedTypeError(
                        f"tensor {name!r}: grok's parallel dense FFN (Grok-2: GELU FFN added to the MoE output "
                        "and scaled by sqrt(2)/2 before ffn_post_norm) is not computed by this executor"
                    )

    @classmethod
    def from_metadata(cls, arch: str, metadata: Mapping[str, Any]) -> MoEHParams:
        """Resolve the MoE hyper-parameters of ``arch`` from GGUF metadata.

        Each architecture's rules are its entry's :class:`~aioexperts._format.archs.MoERule` in the
        registry (:mod:`aioexperts._format.archs`), every rule beside the llama.cpp source it follows;
        this method applies them in llama.cpp's order.

        Args:
            arch: the architecture name (``general.architecture``), e.g. ``"qwen3moe"``.
            metadata: ``{key: value}`` with plain Python values (``int``, ``float``, ``bool``,
                ``str``, lists) as ``gguf.GGUFReader`` field contents give them; keys are the full
                GGUF keys (``qwen3moe.expert_count``).

        Returns:
            The resolved parameters; see the module docstring for each arch's defaults.

        Raises:
            FormatError: a required key is missing (the message names it), has the wrong type, or
                the values are inconsistent (k larger than the expert count, groups that do not
                divide the experts, ...).
            UnsupportedTypeError: the arch is MoE but routes in a way this executor does not
                implement, the gating function is unknown, or a key is a per-layer array.
        """
        rule = _rule_of(arch)
        md = ArchKeys(arch, metadata)
        for name in rule.required:
            if not md.has(name):
                raise md.missing(name)
        counts = ExpertCounts.read(md, rule)
        gating = _gating(md, rule, counts)
        clamp_exp, clamp_shexp = _swiglu_clamps(md, rule, counts.n_layer)
        norm = rule.norm if rule.norm is not None else md.bool_("expert_weights_norm", rule.norm_default)
        scale = md.float_("expert_weights_scale", 0.0) if rule.read_scale else 0.0
        n_ff_exp, n_ff_exp_layers = _expert_width(md, rule, counts)
        n_shared, n_ff_shexp = rule.shared(
            md,
            counts,
            n_ff_exp,
            md.int_("expert_shared_count", default=0),
            md.int_("expert_shared_feed_forward_length", default=0),
        )
        if n_shared < 0 or n_ff_shexp < 0:
            raise FormatError(f"negative shared expert count or width: {n_shared}, {n_ff_shexp}")
        n_hash = md.int_("hash_layer_count", default=0) if rule.hash_routing else 0
        if n_hash < 0 or (counts.n_layer and n_hash > counts.n_layer):
            raise FormatError(
                f"{md.key('hash_layer_count')}={n_hash} must be in 0..{md.key('block_count')}={counts.n_layer}"
            )
        grouped = counts.n_groups > 1
        return cls(
            arch=arch,
            n_layer=counts.n_layer,
            n_embd=counts.n_embd,
            n_expert=counts.n_expert,
            n_expert_used=counts.n_expert_used,
            n_ff_exp=n_ff_exp,
            n_ff=counts.n_ff,
            n_expert_shared=n_shared,
            n_ff_shexp=n_ff_shexp,
            n_layer_dense_lead=counts.n_dense,
            n_layer_nextn=counts.n_nextn,
            gating_func=gating,
            weights_norm=bool(norm),
            weights_scale=float(scale) if scale != 0.0 else 1.0,
            n_expert_groups=counts.n_groups if grouped else 0,
            n_group_used=counts.n_group_used if grouped else 0,
            activation=rule.activation,
            n_moe_layer_step=counts.n_step,
            select_on_logits=rule.select_on_logits,
            weights_before_experts=rule.weights_before_experts,
            verified=moe_rule(arch) is not None,
            status=rule.status,
            n_ff_exp_layers=n_ff_exp_layers,
            swiglu_clamp_exp=clamp_exp,
            swiglu_clamp_shexp=clamp_shexp,
            n_hash_layers=n_hash,
            expert_scales=rule.expert_scales,
        )


def _rule_of(arch: str) -> MoERule:
    """The record of ``arch``; the generic one for a name llama.cpp does not know.

    Raises:
        FormatError: ``arch`` is not a non-empty string.
        UnsupportedTypeError: ``arch`` is refused, or llama.cpp has no MoE layer for it that is implemented.
    """
    if not isinstance(arch, str) or not arch:
        raise FormatError(f"architecture name must be a non-empty string, got {arch!r}")
    if arch in REFUSED:
        raise UnsupportedTypeError(f"architecture {arch!r} is not supported: {REFUSED[arch]}")
    rule = moe_rule(arch)
    if rule is None and arch in LLAMA_CPP_ARCHS:
        raise UnsupportedTypeError(
            f"architecture {arch!r} has no MoE layer in llama.cpp that this executor implements "
            "(see the architecture table in docs/executor.md)"
        )
    return rule if rule is not None else GENERIC


def _gating(md: ArchKeys, rule: MoERule, counts: ExpertCounts) -> GatingFunc:
    """The gating function: fixed by the call site, or ``expert_gating_func`` with the arch's default.

    Raises:
        FormatError: the key is required (llama.cpp's ``build_moe_ffn`` aborts on NONE) and absent.
        UnsupportedTypeError: the value is unknown, or not the one the arch's loader accepts.
    """
    if rule.only_gating is not None:
        raw = md.int_("expert_gating_func", required=True)
        if raw != rule.only_gating:
            raise UnsupportedTypeError(
                f"{md.key('expert_gating_func')}={raw}: llama.cpp's {md.arch} loader accepts only "
                f"{int(rule.only_gating)} ({rule.only_gating.name.lower().replace('_', '')} MoE scoring)"
            )
        return rule.only_gating
    if rule.gating is not None:
        return rule.gating
    raw = md.int_("expert_gating_func", default=0)
    if raw == 0:  # LLAMA_EXPERT_GATING_FUNC_TYPE_NONE: arch default
        if rule.gating_default is None:  # build_moe_ffn aborts on NONE ("fatal error")
            raise FormatError(f"missing required key {md.key('expert_gating_func')} (1..3)")
        if rule.gating_when_absent is not None:
            chosen = rule.gating_when_absent(counts.n_layer - counts.n_nextn, md.vocab_size())
            if chosen is not None:
                return chosen
        return rule.gating_default
    try:
        return GatingFunc(raw)
    except ValueError:
        raise UnsupportedTypeError(
            f"{md.key('expert_gating_func')}={raw} is not supported "
            f"(1 softmax, 2 sigmoid, 3 softmax over the selected logits, 4 sqrt(softplus))"
        ) from None


def _swiglu_clamps(md: ArchKeys, rule: MoERule, n_layer: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-block SwiGLU limits of the routed and the shared experts (deepseek4), else none.

    Raises:
        FormatError: deepseek4 without ``swiglu_clamp_exp``, or bad limits.
        UnsupportedTypeError: another arch sets a clamp (llama-graph.cpp ``build_moe_ffn`` /
            ``build_ffn`` would apply it when the limit is above 1e-6).
    """
    if rule.clamps:  # deepseek4.cpp loader: clamp_exp required, clamp_shexp defaults to clamp_exp
        clamp_exp = md.per_block_floats("swiglu_clamp_exp", n_layer, required=True)
        return clamp_exp, md.per_block_floats("swiglu_clamp_shexp", n_layer, required=False) or clamp_exp
    for clamp_key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
        clamp = md.md.get(md.key(clamp_key))
        values = clamp if isinstance(clamp, list) else [clamp]
        if any(isinstance(v, int | float) and not isinstance(v, bool) and v > _CLAMP_EPS for v in values):
            raise UnsupportedTypeError(f"{md.key(clamp_key)} sets a SwiGLU clamp, which this executor does not apply")
    return (), ()


def _expert_width(md: ArchKeys, rule: MoERule, counts: ExpertCounts) -> tuple[int, tuple[int, ...]]:
    """``(n_ff_exp, per-block widths)``: the key (one value, or per block where the loader uses
    ``get_key_or_arr``), then the arch's width rule.

    Raises:
        FormatError: a width is missing where the rule needs it, or not positive.
    """
    if rule.ff_exp_array and isinstance(md.md.get(md.key("expert_feed_forward_length")), list | tuple):
        # get_key_or_arr: one width per block; the tensors of block L are n_ff_exp(L) wide
        layers = md.per_block_ints("expert_feed_forward_length", counts.n_layer)
        if min(layers) <= 0:
            raise FormatError(f"{md.key('expert_feed_forward_length')} has a width <= 0: {layers}")
        return rule.expert_width(md, counts, layers[0]), layers
    return rule.expert_width(md, counts, md.int_("expert_feed_forward_length", default=0)), ()


_CLAMP_EPS = 1e-6  # llama-graph.cpp build_moe_ffn / build_ffn: a limit <= eps means no clamp


def _clamp_at(limits: tuple[float, ...], layer: int) -> float:
    if 0 <= layer < len(limits) and limits[layer] > _CLAMP_EPS:
        return limits[layer]
    return 0.0
