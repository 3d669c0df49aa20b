"""Typed reading of an architecture's ``{arch}.<name>`` GGUF keys, and the counts every MoE
architecture reads (llama.cpp ``llama_model_base::load_hparams``), checked as llama.cpp asserts them.

Below the architecture registry (:mod:`aioexperts._format.archs`) and :mod:`aioexperts._format.hparams`,
which both read keys through :class:`ArchKeys`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.header import LossyStr, SkippedValue

__all__ = ("LLAMA_MAX_LAYERS", "ArchKeys", "CountRule", "ExpertCounts", "not_an_moe_model", "refuse_a_sidecar")

#: llama.cpp's most blocks (``llama-hparams.h``; its per-block arrays have this size and
#: ``get_key_or_arr`` refuses a larger ``block_count``).
LLAMA_MAX_LAYERS = 512


def not_an_moe_model(arch: str, metadata: Mapping[str, Any]) -> str:
    """What a file without ``{arch}.expert_count`` is, in words that follow its name: a miss-tier
    sidecar given instead of its model (``is a miss-tier sidecar of MODEL, not a model: pass the
    model``), else a dense model (``is not a MoE model (no ARCH.expert_count): ...``)."""
    from .tier_sidecar import TIER_ARCH  # a sidecar is read through layout, above this module

    if arch == TIER_ARCH:
        name = metadata.get("general.name")  # "aioexperts miss tier (TYPE) of MODEL", as aioexperts-tier writes it
        of = name.rpartition(" of ")[2] if isinstance(name, str) and " of " in name else ""
        return f"is a miss-tier sidecar{f' of {of}' if of else ''}, not a model: pass the model"
    return f"is not a MoE model (no {arch}.expert_count): aioexperts streams the experts of MoE models"


def refuse_a_sidecar(path: str, arch: object, metadata: Mapping[str, Any]) -> None:
    """Raise FormatError ``PATH is a miss-tier sidecar of MODEL, not a model: pass the model`` when
    ``arch`` (the file's ``general.architecture``) is the miss-tier sidecar's; else nothing."""
    from .tier_sidecar import TIER_ARCH  # a sidecar is read through layout, above this module

    if arch == TIER_ARCH:
        raise FormatError(f"{path} {not_an_moe_model(TIER_ARCH, metadata)}")


class CountRule(Protocol):
    """What :meth:`ExpertCounts.read` needs of an architecture's MoE rule."""

    @property
    def dense_lead(self) -> bool: ...

    @property
    def moe_step(self) -> bool: ...


class ArchKeys:
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

    def missing(self, name: str) -> FormatError:
        """The error of a required key that is absent (``expert_count``: the file is not an MoE model)."""
        if name == "expert_count":
            return FormatError(f"the file {not_an_moe_model(self.arch, self.md)}")
        return FormatError(f"missing required key {self.key(name)}")

    def _get(self, name: str, required: bool) -> Any:
        value = self.md.get(self.key(name))
        if value is None and required:
            raise self.missing(name)
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

    def _per_block(self, name: str, n_layer: int, required: bool) -> list[Any] | None:
        """``get_key_or_arr``: one value for every block, or an array of exactly ``block_count`` values."""
        value = self.md.get(self.key(name))
        if value is None:
            if required:
                raise FormatError(f"missing required key {self.key(name)}")
            return None
        if isinstance(value, SkippedValue):
            raise FormatError(f"{self.key(name)} has {len(value)} values, more than any block count")
        if not isinstance(value, list | tuple):
            return [value] * max(n_layer, 1)
        if n_layer <= 0:
            raise FormatError(f"{self.key(name)} is a per-block array but {self.key('block_count')} is missing")
        if len(value) != n_layer:
            raise FormatError(
                f"{self.key(name)} has {len(value)} values, expected one per block "
                f"({self.key('block_count')}={n_layer})"
            )
        return list(value)

    def per_block_ints(self, name: str, n_layer: int) -> tuple[int, ...]:
        values = self._per_block(name, n_layer, True) or []
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values):
            raise FormatError(f"{self.key(name)} must hold integers, got {values!r:.120}")
        return tuple(int(v) for v in values)

    def per_block_floats(self, name: str, n_layer: int, *, required: bool) -> tuple[float, ...]:
        values = self._per_block(name, n_layer, required)
        if values is None:
            return ()
        if any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in values):
            raise FormatError(f"{self.key(name)} must hold numbers, got {values!r:.120}")
        floats = tuple(float(v) for v in values)
        if not all(math.isfinite(v) and v >= 0.0 for v in floats):
            raise FormatError(f"{self.key(name)} must hold finite limits >= 0, got {floats!r:.120}")
        return floats

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


@dataclass(frozen=True, slots=True)
class ExpertCounts:
    """The counts every arch reads (``llama_model_base::load_hparams``), checked as llama.cpp asserts them."""

    n_embd: int
    n_expert: int
    n_expert_used: int
    n_layer: int
    n_ff: int
    n_dense: int
    n_step: int
    n_nextn: int
    n_groups: int
    n_group_used: int

    @classmethod
    def read(cls, md: ArchKeys, rule: CountRule) -> ExpertCounts:
        counts = cls(
            n_embd=md.int_("embedding_length", required=True),
            n_expert=md.int_("expert_count", required=True),
            n_expert_used=md.int_("expert_used_count", required=True),
            n_layer=md.int_("block_count", default=0),
            n_ff=md.int_("feed_forward_length", default=0),
            # leading dense blocks and interleaving only where the arch's loader reads the key and its
            # graph honours it (deepseek*, glm4moe, ernie4_5-moe, bailingmoe2, dots1); elsewhere ignored
            n_dense=md.int_("leading_dense_block_count", default=0) if rule.dense_lead else 0,
            n_step=md.int_("interleave_moe_layer_step", required=True) if rule.moe_step else 0,
            n_nextn=md.int_("nextn_predict_layers", default=0),
            n_groups=md.int_("expert_group_count", default=0),
            n_group_used=md.int_("expert_group_used_count", default=0),
        )
        counts._check(md, rule)
        return counts

    def _check(self, md: ArchKeys, rule: CountRule) -> None:
        n_layer, n_expert = self.n_layer, self.n_expert
        if self.n_embd <= 0:
            raise FormatError(f"{md.key('embedding_length')} must be > 0, got {self.n_embd}")
        if n_expert <= 0:
            raise FormatError(f"{md.key('expert_count')} must be > 0 for an MoE model, got {n_expert}")
        if not 0 < self.n_expert_used <= n_expert:
            raise FormatError(
                f"{md.key('expert_used_count')} must be in 1..{n_expert} ({md.key('expert_count')}), "
                f"got {self.n_expert_used}"
            )
        if rule.moe_step and self.n_step <= 0:
            raise FormatError(f"{md.key('interleave_moe_layer_step')} must be > 0, got {self.n_step}")
        if n_layer and self.n_nextn >= n_layer:  # llama.cpp: GGML_ASSERT(n_layer_nextn < n_layer_all)
            raise FormatError(
                f"{md.key('nextn_predict_layers')}={self.n_nextn} must be below {md.key('block_count')}={n_layer}"
            )
        if n_layer > LLAMA_MAX_LAYERS:  # checked before anything sized by it is made
            raise FormatError(
                f"{md.key('block_count')}={n_layer} is more than llama.cpp's {LLAMA_MAX_LAYERS} blocks "
                "(LLAMA_MAX_LAYERS): a corrupt file"
            )
        if n_layer < 0 or self.n_dense < 0 or self.n_nextn < 0 or self.n_ff < 0:
            raise FormatError(
                f"negative layer or width count in {md.arch} metadata: block_count={n_layer}, "
                f"leading_dense_block_count={self.n_dense}, nextn_predict_layers={self.n_nextn}, "
                f"feed_forward_length={self.n_ff}"
            )
        if n_layer and self.n_dense > n_layer:
            raise FormatError(
                f"{md.key('leading_dense_block_count')}={self.n_dense} exceeds {md.key('block_count')}={n_layer}"
            )
        self._check_groups(md)

    def _check_groups(self, md: ArchKeys) -> None:
        """llama-model.cpp ``load_hparams`` asserts on ``expert_group_count`` / ``expert_group_used_count``."""
        n_groups, n_group_used, n_expert = self.n_groups, self.n_group_used, self.n_expert
        if n_groups > 1:
            if n_expert % n_groups:
                raise FormatError(
                    f"{md.key('expert_group_count')}={n_groups} does not divide {md.key('expert_count')}={n_expert}"
                )
            if not 0 < n_group_used <= n_groups:
                raise FormatError(f"{md.key('expert_group_used_count')} must be in 1..{n_groups}, got {n_group_used}")
            if self.n_expert_used > n_group_used * (n_expert // n_groups):
                raise FormatError(
                    f"top-{self.n_expert_used} cannot be chosen from {n_group_used} groups of "
                    f"{n_expert // n_groups} experts"
                )
        elif n_groups < 0 or n_group_used < 0:
            raise FormatError(f"negative expert group counts: {n_groups}, {n_group_used}")
