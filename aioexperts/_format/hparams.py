"""MoE hyper-parameters of a GGUF model, resolved per architecture the way llama.cpp resolves them.

:meth:`MoEHParams.from_metadata` takes the architecture name (``general.architecture``) and a plain
mapping ``{key: python value}`` of the GGUF metadata (keys such as ``qwen3moe.expert_count``) and
returns a frozen :class:`MoEHParams`. The values that drive the routing (gating function, weight
normalisation, weight scale) are taken from the same place llama.cpp takes them: either the arch's
``build_moe_ffn`` call site hard-codes them (then the metadata key is *ignored*, exactly as llama.cpp
ignores it), or the arch's hparams loader reads the key (then the arch's default applies when the key
is missing).

The routing semantics themselves are llama.cpp's ``build_moe_ffn`` (src/llama-graph.cpp).

| arch        | gating          | norm   | scale | ``n_ff_exp``     | shared expert        | act  | ref |
|-------------|-----------------|--------|-------|------------------|----------------------|------|-----|
| qwen2moe    | softmax         | no     | 1     | key, else ff/k   | 1, sig-gated         | silu | [1] |
| qwen3moe    | softmax         | yes    | 1     | key, else ff/k   | none                 | silu | [2] |
| qwen3next   | softmax         | yes    | 1     | key, else ff/k   | key width, sig-gated | silu | [3] |
| llama       | softmax         | yes    | 1     | n_ff             | none                 | silu | [4] |
| olmoe       | softmax         | no     | 1     | n_ff             | none                 | silu | [5] |
| deepseek    | softmax         | no     | 1     | key (required)   | count x n_ff_exp     | silu | [6] |
| deepseek2   | key/softmax (*) | key/no | key/1 | key (required)   | count x n_ff_exp     | silu | [7] |
| glm4moe     | key/sigmoid     | key/no | key/1 | key (required)   | count x n_ff_exp     | silu | [8] |
| gpt-oss     | top-k softmax   | no     | 1     | key (required)   | none                 | oai  | [9] |
| (any other) | key/softmax     | key/no | key/1 | key, else 0 (**) | key, else count x ff | silu | -   |

A plain value is "fixed": the ``build_moe_ffn`` call site passes a constant and the metadata key is
ignored, as llama.cpp ignores it (for the scale: the arch's loader never reads
``expert_weights_scale``, so llama.cpp passes 0, i.e. no scaling). "key/X": the key
(``{arch}.expert_gating_func``, ``expert_weights_norm``, ``expert_weights_scale``) is read, X when it
is missing. "top-k softmax": gating 3, softmax over the k selected logits. For ``n_ff_exp``, "key" is
``expert_feed_forward_length``, "n_ff" is ``feed_forward_length`` and "ff/k" is
``n_ff // expert_used_count``. "count x n_ff_exp": ``expert_shared_count * n_ff_exp``, ungated.
"sig-gated": the shared output is multiplied by ``sigmoid(x . ffn_gate_inp_shexp)``; its width is
``expert_shared_feed_forward_length``, else (qwen2moe) ``feed_forward_length``. "oai": ``swiglu_oai``
with alpha 1.702 and limit 7.0, plus the router and expert biases. (*) deepseek2 without
``expert_gating_func`` is sigmoid for GLM-4.7 Lite (47 or 48 layers, vocabulary 154880).
(**) 0 means unknown: the executor takes the width from the expert views.

References (llama.cpp): [1] src/models/qwen2moe.cpp (``SOFTMAX``, ``norm_w=false``, shared gate
``silu(v)/v``); [2] src/models/qwen3moe.cpp; [3] src/models/qwen3next.cpp ``build_layer_ffn``;
[4] src/models/llama.cpp, MoE branch when ``expert_count > 0`` (Mixtral); [5] src/models/olmoe.cpp;
[6] src/models/deepseek.cpp (``norm_w=false, scale_w=false``) and the ``LLM_ARCH_DEEPSEEK`` loader;
[7] the DeepSeek2 loader ("for compatibility with existing DeepSeek V2 and V2.5 GGUFs") and
src/models/deepseek2.cpp; [8] src/models/glm4-moe.cpp ``load_arch_hparams`` (gating default
sigmoid, ``n_ff_shexp = n_ff_exp * n_expert_shared``); [9] src/models/openai-moe-iswa.cpp
(``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT``, ``LLM_FFN_SWIGLU_OAI_MOE``).

For every arch (llama-model.cpp ``load_hparams``): ``block_count``, ``embedding_length``,
``expert_count``, ``expert_used_count``, ``expert_group_count`` and ``expert_group_used_count`` are
read; ``leading_dense_block_count`` is read when present (0 otherwise). A weight scale of 0 or 1
means "no scaling" (``build_moe_ffn`` applies it only when ``w_scale != 0 && w_scale != 1``).

Architectures whose routing this executor does not implement (``llama4``: weights applied before the
FFN and a sigmoid after top-k; ``grovemoe``: adjugate expert groups) raise
:class:`~aioexperts._errors.UnsupportedTypeError` instead of silently taking the generic path.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.header import LossyStr, SkippedValue

__all__ = ("Activation", "GatingFunc", "MoEHParams")


class GatingFunc(enum.IntEnum):
    """``{arch}.expert_gating_func`` (llama.cpp ``llama_expert_gating_func_type``)."""

    SOFTMAX = 1
    """Probabilities are ``softmax(logits)`` over all experts."""
    SIGMOID = 2
    """Probabilities are ``sigmoid(logits)`` per expert (DeepSeek-V3, GLM-4.5)."""
    SOFTMAX_WEIGHT = 3
    """Select on the raw logits, then ``softmax`` over the k selected logits (gpt-oss)."""


class Activation(enum.StrEnum):
    """The gated activation of the routed experts."""

    SILU = "silu"
    """SwiGLU: ``silu(gate) * up``."""
    SWIGLU_OAI = "swiglu_oai"
    """gpt-oss: ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``, ``g*sigmoid(alpha*g)*(u+1)``."""


_SWIGLU_OAI_ALPHA = 1.702  # llama-graph.cpp build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE
_SWIGLU_OAI_LIMIT = 7.0

# How llama.cpp obtains one value for an arch: a constant at the build_moe_ffn call site ("fixed"),
# or the metadata key with a default.
_FF_KEY_OR_FF_DIV_USED = "key_or_ff_div_used"  # qwen*: n_ff_exp ? n_ff_exp : n_ff / n_expert_used
_FF_FEED_FORWARD = "feed_forward_length"  # llama (Mixtral), olmoe: experts are n_ff wide
_FF_KEY_REQUIRED = "key_required"  # deepseek, deepseek2, glm4moe, gpt-oss
_FF_KEY_OPTIONAL = "key_optional"  # generic

_SH_NONE = "none"
_SH_QWEN2 = "qwen2"  # one shared expert, n_ff_shexp = key or n_ff
_SH_KEY = "key"  # n_ff_shexp from the key (0: none)
_SH_COUNT_X_FF_EXP = "count_x_ff_exp"  # n_ff_shexp = n_ff_exp * expert_shared_count (required key)
_SH_GENERIC = "generic"  # key, else count * n_ff_exp


@dataclass(frozen=True, slots=True)
class _ArchRule:
    gating: GatingFunc | None  # fixed by the call site; None: read the key
    gating_default: GatingFunc
    norm: bool | None  # fixed; None: read the key
    norm_default: bool
    read_scale: bool  # False: the call site never scales (key ignored)
    n_ff_exp: str
    shared: str
    activation: Activation = Activation.SILU


_RULES: dict[str, _ArchRule] = {
    "qwen2moe": _ArchRule(
        GatingFunc.SOFTMAX, GatingFunc.SOFTMAX, False, False, False, _FF_KEY_OR_FF_DIV_USED, _SH_QWEN2
    ),
    "qwen3moe": _ArchRule(GatingFunc.SOFTMAX, GatingFunc.SOFTMAX, True, True, False, _FF_KEY_OR_FF_DIV_USED, _SH_NONE),
    "qwen3next": _ArchRule(GatingFunc.SOFTMAX, GatingFunc.SOFTMAX, True, True, False, _FF_KEY_OR_FF_DIV_USED, _SH_KEY),
    "llama": _ArchRule(GatingFunc.SOFTMAX, GatingFunc.SOFTMAX, True, True, False, _FF_FEED_FORWARD, _SH_NONE),
    "olmoe": _ArchRule(GatingFunc.SOFTMAX, GatingFunc.SOFTMAX, False, False, False, _FF_FEED_FORWARD, _SH_NONE),
    "deepseek": _ArchRule(
        GatingFunc.SOFTMAX, GatingFunc.SOFTMAX, False, False, False, _FF_KEY_REQUIRED, _SH_COUNT_X_FF_EXP
    ),
    "deepseek2": _ArchRule(None, GatingFunc.SOFTMAX, None, False, True, _FF_KEY_REQUIRED, _SH_COUNT_X_FF_EXP),
    "glm4moe": _ArchRule(None, GatingFunc.SIGMOID, None, False, True, _FF_KEY_REQUIRED, _SH_COUNT_X_FF_EXP),
    "gpt-oss": _ArchRule(
        GatingFunc.SOFTMAX_WEIGHT,
        GatingFunc.SOFTMAX_WEIGHT,
        False,
        False,
        False,
        _FF_KEY_REQUIRED,
        _SH_NONE,
        Activation.SWIGLU_OAI,
    ),
}
_GENERIC = _ArchRule(None, GatingFunc.SOFTMAX, None, False, True, _FF_KEY_OPTIONAL, _SH_GENERIC)

_UNSUPPORTED = {
    "llama4": "llama4 applies the routing weights before the FFN and a sigmoid after top-k",
    "grovemoe": "grovemoe routes through adjugate expert groups",
}

# deepseek2 without expert_gating_func: GLM-4.7 Lite (47 or 48 layers, vocabulary of 154880) is sigmoid.
_GLM47_LITE_LAYERS = (47, 48)
_GLM47_LITE_VOCAB = 154880


@dataclass(frozen=True, slots=True)
class MoEHParams:
    """The MoE hyper-parameters of one model, as llama.cpp's ``build_moe_ffn`` sees them.

    Attributes:
        arch: ``general.architecture``.
        n_layer: ``block_count`` (0 when absent: unknown).
        n_embd: ``embedding_length``.
        n_expert: ``expert_count``: router outputs of a full layer (a pruned mixed-tier layer may
            have fewer, see FORMATS.md section 2).
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
        verified: the arch is in the table above; False means the generic rules were applied
            (the engine logs a warning: results may differ from llama.cpp).
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
    verified: bool = True

    @property
    def uses_groups(self) -> bool:
        """True when selection is group-limited (``n_expert_groups > 1``)."""
        return self.n_expert_groups > 1

    @property
    def has_shared_expert(self) -> bool:
        """True when the model declares shared experts (their tensors decide in the end)."""
        return self.n_expert_shared > 0 or self.n_ff_shexp > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has routed experts (not one of the leading dense blocks)."""
        if layer < 0 or (self.n_layer and layer >= self.n_layer):
            return False
        return layer >= self.n_layer_dense_lead

    @classmethod
    def from_metadata(cls, arch: str, metadata: Mapping[str, Any]) -> MoEHParams:
        """Resolve the MoE hyper-parameters of ``arch`` from GGUF metadata.

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
        if not isinstance(arch, str) or not arch:
            raise FormatError(f"architecture name must be a non-empty string, got {arch!r}")
        if arch in _UNSUPPORTED:
            raise UnsupportedTypeError(f"architecture {arch!r} is not supported: {_UNSUPPORTED[arch]}")
        rule = _RULES.get(arch, _GENERIC)
        md = _Meta(arch, metadata)

        n_embd = md.int_("embedding_length", required=True)
        n_expert = md.int_("expert_count", required=True)
        n_expert_used = md.int_("expert_used_count", required=True)
        n_layer = md.int_("block_count", default=0)
        n_ff = md.int_("feed_forward_length", default=0)
        n_dense = md.int_("leading_dense_block_count", default=0)
        n_nextn = md.int_("nextn_predict_layers", default=0)
        n_groups = md.int_("expert_group_count", default=0)
        n_group_used = md.int_("expert_group_used_count", default=0)

        if n_embd <= 0:
            raise FormatError(f"{md.key('embedding_length')} must be > 0, got {n_embd}")
        if n_expert <= 0:
            raise FormatError(f"{md.key('expert_count')} must be > 0 for an MoE model, got {n_expert}")
        if not 0 < n_expert_used <= n_expert:
            raise FormatError(
                f"{md.key('expert_used_count')} must be in 1..{n_expert} ({md.key('expert_count')}), "
                f"got {n_expert_used}"
            )
        if n_layer < 0 or n_dense < 0 or n_nextn < 0 or n_ff < 0:
            raise FormatError(
                f"negative layer or width count in {arch} metadata: block_count={n_layer}, "
                f"leading_dense_block_count={n_dense}, nextn_predict_layers={n_nextn}, "
                f"feed_forward_length={n_ff}"
            )
        if n_layer and n_dense > n_layer:
            raise FormatError(
                f"{md.key('leading_dense_block_count')}={n_dense} exceeds {md.key('block_count')}={n_layer}"
            )

        # groups (llama-model.cpp load_hparams asserts)
        if n_groups > 1:
            if n_expert % n_groups:
                raise FormatError(
                    f"{md.key('expert_group_count')}={n_groups} does not divide {md.key('expert_count')}={n_expert}"
                )
            if not 0 < n_group_used <= n_groups:
                raise FormatError(f"{md.key('expert_group_used_count')} must be in 1..{n_groups}, got {n_group_used}")
            if n_expert_used > n_group_used * (n_expert // n_groups):
                raise FormatError(
                    f"top-{n_expert_used} cannot be chosen from {n_group_used} groups of {n_expert // n_groups} experts"
                )
        elif n_groups < 0 or n_group_used < 0:
            raise FormatError(f"negative expert group counts: {n_groups}, {n_group_used}")

        # gating
        if rule.gating is not None:
            gating = rule.gating
        else:
            raw = md.int_("expert_gating_func", default=0)
            if raw == 0:  # LLAMA_EXPERT_GATING_FUNC_TYPE_NONE: arch default
                gating = rule.gating_default
                if arch == "deepseek2" and _is_glm47_lite(n_layer - n_nextn, md.vocab_size()):
                    gating = GatingFunc.SIGMOID
            else:
                try:
                    gating = GatingFunc(raw)
                except ValueError:
                    raise UnsupportedTypeError(
                        f"{md.key('expert_gating_func')}={raw} is not supported "
                        f"(1 softmax, 2 sigmoid, 3 softmax over the selected logits)"
                    ) from None

        norm = rule.norm if rule.norm is not None else md.bool_("expert_weights_norm", rule.norm_default)
        scale = md.float_("expert_weights_scale", 0.0) if rule.read_scale else 0.0
        if scale == 0.0:
            scale = 1.0

        # expert width
        n_ff_exp = md.int_("expert_feed_forward_length", default=0)
        if rule.n_ff_exp == _FF_KEY_REQUIRED:
            if n_ff_exp <= 0:
                raise FormatError(f"missing required key {md.key('expert_feed_forward_length')}")
        elif rule.n_ff_exp == _FF_KEY_OR_FF_DIV_USED:
            if n_ff_exp <= 0:
                if n_ff <= 0:
                    raise FormatError(
                        f"missing required key {md.key('expert_feed_forward_length')} "
                        f"(and no {md.key('feed_forward_length')} to derive it from)"
                    )
                n_ff_exp = n_ff // n_expert_used
        elif rule.n_ff_exp == _FF_FEED_FORWARD:
            # the expert tensors are created n_ff wide; the expert key is not read
            if n_ff <= 0:
                raise FormatError(f"missing required key {md.key('feed_forward_length')}")
            n_ff_exp = n_ff
        elif n_ff_exp < 0:
            raise FormatError(f"{md.key('expert_feed_forward_length')} must be >= 0, got {n_ff_exp}")

        # shared experts
        n_shared = md.int_("expert_shared_count", default=0)
        n_ff_shexp_key = md.int_("expert_shared_feed_forward_length", default=0)
        if rule.shared == _SH_NONE:
            n_shared, n_ff_shexp = 0, 0
        elif rule.shared == _SH_QWEN2:
            n_shared = 1
            n_ff_shexp = n_ff_shexp_key or n_ff
        elif rule.shared == _SH_KEY:
            n_ff_shexp = n_ff_shexp_key
            n_shared = 1 if n_ff_shexp > 0 else 0
        elif rule.shared == _SH_COUNT_X_FF_EXP:
            if not md.has("expert_shared_count"):
                raise FormatError(f"missing required key {md.key('expert_shared_count')}")
            n_ff_shexp = n_ff_exp * n_shared
        else:  # generic
            n_ff_shexp = n_ff_shexp_key or (n_ff_exp * n_shared)
            if n_ff_shexp and not n_shared:
                n_shared = 1
        if n_shared < 0 or n_ff_shexp < 0:
            raise FormatError(f"negative shared expert count or width: {n_shared}, {n_ff_shexp}")

        return cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_ff_exp=n_ff_exp,
            n_ff=n_ff,
            n_expert_shared=n_shared,
            n_ff_shexp=n_ff_shexp,
            n_layer_dense_lead=n_dense,
            n_layer_nextn=n_nextn,
            gating_func=gating,
            weights_norm=bool(norm),
            weights_scale=float(scale),
            n_expert_groups=n_groups if n_groups > 1 else 0,
            n_group_used=n_group_used if n_groups > 1 else 0,
            activation=rule.activation,
            verified=arch in _RULES,
        )


def _is_glm47_lite(n_layer: int, n_vocab: int | None) -> bool:
    return n_layer in _GLM47_LITE_LAYERS and n_vocab == _GLM47_LITE_VOCAB


class _Meta:
    """Typed access to ``{arch}.<name>`` keys with errors that name the key."""

    def __init__(self, arch: str, metadata: Mapping[str, Any]) -> None:
        if not isinstance(metadata, Mapping):
            raise FormatError(f"metadata must be a mapping, got {type(metadata).__name__}")
        self.arch = arch
        self.md = metadata

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        return self.md.get(self.key(name)) is not None

    def _get(self, name: str, required: bool) -> Any:
        value = self.md.get(self.key(name))
        if value is None and required:
            raise FormatError(f"missing required key {self.key(name)}")
        if isinstance(value, list | tuple | SkippedValue):
            raise UnsupportedTypeError(
                f"{self.key(name)} is a per-layer array ({len(value)} values); only a single value is supported"
            )
        if isinstance(value, LossyStr):
            raise FormatError(f"{self.key(name)} is a string that is not valid UTF-8 ({value.raw!r})")
        return value

    def int_(self, name: str, *, required: bool = False, default: int = 0) -> int:
        value = self._get(name, required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise FormatError(f"{self.key(name)} must be an integer, got {value!r}")
        return int(value)

    def float_(self, name: str, default: float) -> float:
        value = self._get(name, False)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise FormatError(f"{self.key(name)} must be a number, got {value!r}")
        return float(value)

    def bool_(self, name: str, default: bool) -> bool:
        value = self._get(name, False)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, numbers.Integral) and int(value) in (0, 1):
            return bool(value)
        raise FormatError(f"{self.key(name)} must be a boolean, got {value!r}")

    def vocab_size(self) -> int | None:
        value = self.md.get(self.key("vocab_size"))
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        # llama.cpp: get_key(LLM_KV_VOCAB_SIZE) || get_arr_n(LLM_KV_TOKENIZER_LIST): the length of the
        # token list, which open_model leaves in the file (a SkippedValue) but whose length it keeps
        tokens = self.md.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list | tuple | SkippedValue):
            return len(tokens)
        return None
