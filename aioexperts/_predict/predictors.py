"""Next-layer expert predictors: which experts of layer N+1 to prefetch while layer N computes.

The runner routes layer ``N``, calls :meth:`Predictor.observe` with that layer's input and chosen ids,
asks :meth:`Predictor.predict` for the experts of the next MoE layer and hands them to
``cache.prefetch`` (never awaited), then computes layer ``N``. A predictor only returns ids; it knows
nothing about the cache, the slab or I/O. Its list is ordered most likely first, so a caller that can
only afford fewer reads takes a prefix.

Three strategies, each a baseline of the literature:

- :class:`NextRouterPredictor` (``"router"``): the next layer's router applied to the current
  layer's MoE input. Training-free cross-layer gating as in Fate (Fang et al., "Fate: Fast Edge
  Inference of Mixture-of-Experts Models via Cross-Layer Gate", arXiv:2502.12224, 2025), whose key
  observation is that the gate inputs of adjacent layers are similar enough to prefetch with.
  Pre-gated MoE (Hwang et al., "Pre-gated MoE: An Algorithm-System Co-Design for Fast and Scalable
  Mixture-of-Expert Inference", ISCA 2024, arXiv:2308.12066) is the *trained* variant: it
  fine-tunes a pre-gate that selects the next block's experts; aioexperts uses the model as is.
- :class:`PreviousTokenPredictor` (``"previous"``): the experts the previous token chose at the
  next layer (temporal locality of routing).
- :class:`FrequencyPredictor` (``"frequency"``): the experts chosen most often so far at the next
  layer, with exponentially decayed counts (per-layer popularity).

:func:`make_predictor` builds one by name (``"none"``: :class:`NullPredictor`, never predicts).
:mod:`aioexperts._predict.scoring` replays routing data through predictors and measures them.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from aioexperts._compute.gating import select_experts, sigmoid, softmax, sqrt_softplus
from aioexperts._compute.moe import ResidentLayer, router_logits
from aioexperts._errors import ConfigError, InvalidRequestError
from aioexperts._format.hparams import GatingFunc, MoEHParams

__all__ = (
    "DEFAULT_FREQUENCY_DECAY",
    "PREDICTORS",
    "FrequencyPredictor",
    "NextRouterPredictor",
    "NullPredictor",
    "PreviousTokenPredictor",
    "Predictor",
    "make_predictor",
)

DEFAULT_FREQUENCY_DECAY = 0.99
"""Default per-token decay of :class:`FrequencyPredictor`.

A count observed ``t`` tokens ago weighs ``0.99 ** t``: a half-life of about 69 tokens and an
effective memory of ``1 / (1 - 0.99) = 100`` tokens. Long enough to estimate a layer's popular
experts from more than a handful of tokens, short enough to follow a topic change within a few
hundred tokens; the short-term (token-to-token) locality is :class:`PreviousTokenPredictor`'s job.
"""


class Predictor(ABC):
    """Predicts the experts of the next MoE layer; one instance follows one sequence at a time.

    Call order, per token (or batch of tokens) and MoE layer ``N`` (next MoE layer ``N'``):
    ``observe(N, x, ids)`` right after layer ``N`` routed, then ``predict(N, N', x, budget)`` before
    layer ``N`` computes. ``reset()`` between sequences. Predictors hold no I/O state and are not
    thread-safe: one caller at a time.

    Attributes:
        name: the registry name (:func:`make_predictor`), also the key of scoring results.
        stateless: True when :meth:`observe` learns nothing (it only checks its arguments): the
            router then does not call it (about 15 us a layer; :func:`observe_skipped`). It
            vouches only for the ``observe`` its class had when it was set: a subclass, a mixin
            or an assignment that brings another ``observe`` is observed unless its class sets
            ``stateless`` again.
    """

    name: ClassVar[str]
    stateless: ClassVar[bool] = False
    #: the ``observe`` the class that set ``stateless`` had then: the one it vouches for
    _stateless_observe: ClassVar[Any] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "stateless" in cls.__dict__:
            cls._stateless_observe = cls.observe if cls.stateless else None

    @abstractmethod
    def observe(self, layer: int, x: np.ndarray | None, ids: np.ndarray) -> None:
        """Record what layer ``layer`` just routed.

        Args:
            layer: block index of the MoE layer that routed.
            x: that layer's MoE input, ``(n_tokens, n_embd)`` float32, or None when unknown.
            ids: the selected ids, ``(n_tokens, k)`` integers (a ``(k,)`` row is one token);
                ``-1`` marks an inactive slot and is ignored.

        Raises:
            InvalidRequestError: ``ids`` is not an integer array of 1 or 2 dimensions, or holds an
                id below ``-1``.
        """

    @abstractmethod
    def predict(self, layer: int, next_layer: int, x: np.ndarray | None, budget: int) -> list[int]:
        """The experts of ``next_layer`` most likely to be selected, most likely first.

        Args:
            layer: block index of the layer about to compute.
            next_layer: block index of the next MoE layer, whose experts are predicted.
            x: the MoE input of ``layer``, ``(n_tokens, n_embd)`` float32 (None when unknown;
                predictors that need it then return ``[]``).
            budget: the most ids to return, ``>= 0``.

        Returns:
            At most ``budget`` distinct non-negative expert ids (Python ints) of ``next_layer``;
            possibly fewer, possibly none.

        Raises:
            ConfigError: ``budget`` is negative or not an int.
        """

    def predict_weighted(
        self, layer: int, next_layer: int, x: np.ndarray | None, budget: int
    ) -> tuple[list[int], dict[int, float]]:
        """:meth:`predict`, with the gate weight each predicted expert is expected to get where the
        predictor knows it (its largest over the rows of ``x``; the miss tier reads a prefetch of
        low weight at low precision). The default knows none: ``(self.predict(...), {})``.

        Returns:
            The ids as :meth:`predict` returns them, and id -> routing weight (a finite float, as
            ``select_experts`` gives it) for some of them.

        Raises:
            As :meth:`predict`.
        """
        return self.predict(layer, next_layer, x, budget), {}

    def reset(self) -> None:  # noqa: B027 - a no-op default, not abstract: stateless predictors keep it
        """Forget everything observed (start of a new sequence). Stateless predictors: no-op."""


# --------------------------------------------------------------------------------------------------
# helpers


def _check_budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ConfigError(f"budget must be a non-negative int, got {budget!r}")
    return int(budget)


def observe_skipped(predictor: Predictor) -> bool:
    """Whether the router may skip ``predictor.observe``: its class is ``stateless`` for the very
    ``observe`` it runs (not one a subclass, a mixin, a later assignment or the instance brought)."""
    cls = type(predictor)
    vouched = cls._stateless_observe
    return (
        vouched is not None
        and cls.stateless
        and cls.observe is vouched
        and "observe" not in getattr(predictor, "__dict__", ())
    )


def _check_ids(ids: np.ndarray) -> np.ndarray:
    """``ids`` as a ``(n_tokens, k)`` int64 array; a ``(k,)`` row is one token."""
    a = np.asarray(ids)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or (a.size and a.dtype.kind not in "iu"):
        raise InvalidRequestError(f"ids must be integers of shape (n_tokens, k) or (k,), got {a.dtype} {a.shape}")
    a = a.astype(np.int64, copy=False)
    if a.size and int(a.min()) < -1:
        raise InvalidRequestError(f"expert ids must be >= -1 (-1: inactive), got {int(a.min())}")
    return a


def _votes(ids: np.ndarray) -> np.ndarray:
    """``(n_tokens, max_id + 1)`` bool: token ``t`` selected expert ``e`` (duplicates once, -1 ignored)."""
    n_tokens = ids.shape[0]
    width = int(ids.max()) + 1 if ids.size else 0
    chosen = np.zeros((n_tokens, max(width, 0)), dtype=bool)
    rows, slots = np.nonzero(ids >= 0)
    chosen[rows, ids[rows, slots]] = True
    return chosen


def _rank(primary: np.ndarray, secondary: np.ndarray | None, budget: int) -> list[int]:
    """Ids with ``primary > 0``, by ``primary`` desc, then ``secondary`` desc, then id asc."""
    candidates = np.flatnonzero(primary > 0)
    if candidates.size == 0 or budget == 0:
        return []
    keys = [candidates, -primary[candidates]]
    if secondary is not None:
        keys.insert(1, -secondary[candidates])
    order = np.lexsort(keys)  # the last key is the primary one
    return [int(e) for e in candidates[order[:budget]]]


# --------------------------------------------------------------------------------------------------
# predictors


class NullPredictor(Predictor):
    """Never predicts anything: prefetching off (``"none"``), and the zero line of a score table."""

    name: ClassVar[str] = "none"
    stateless: ClassVar[bool] = True

    def observe(self, layer: int, x: np.ndarray | None, ids: np.ndarray) -> None:
        _check_ids(ids)

    def predict(self, layer: int, next_layer: int, x: np.ndarray | None, budget: int) -> list[int]:
        _check_budget(budget)
        return []


class NextRouterPredictor(Predictor):
    """The next layer's router applied to the current layer's MoE input (lookahead gating).

    Why it works: a transformer block adds its attention and FFN outputs to a residual stream, so the
    hidden state entering block ``N+1`` is the one entering block ``N`` plus two updates that are
    usually small next to it; the (normalised) MoE input of layer ``N`` is therefore close to that of
    layer ``N+1``, and ``route(x_N, router_{N+1})`` approximates ``route(x_{N+1}, router_{N+1})``.
    Fate (Fang et al., arXiv:2502.12224, 2025) prefetches with exactly this training-free cross-layer
    gate; Pre-gated MoE (Hwang et al., ISCA 2024) trains a dedicated pre-gate instead. The
    approximation ignores that each layer's FFN norm has its own weights.

    Ranking (the choice made here): the *union of the per-token top-k* that the next layer's full
    routing (:func:`~aioexperts._compute.gating.select_experts`: gating function, selection bias
    ``exp_probs_b``, group-limited selection) picks for ``x``, ordered by the number of tokens that
    picked each expert, then by the summed selection score (probability plus selection bias) over
    those tokens, then by id. Rather than ranking all experts by summed probability, because:

    - for one token (decode, where prefetching matters most) the prediction is exactly what the
      router would choose if ``x`` were the next layer's input, in llama.cpp's order, and that
      includes the selection bias and the group limits, which steer the *choice* but are invisible
      in the probabilities;
    - with many tokens (prefill) the vote count is the number of tokens that would use the expert,
      i.e. the demand the read must serve; summed probability credits diffuse mass no token selects;
    - it never pads the list with experts no token would select: ``budget`` is a cap, not a quota,
      and a guess outside every top-k would mostly be wasted bytes.

    Args:
        residents: block index -> that layer's resident weights (router, router bias, selection bias);
            a ``next_layer`` missing from it yields ``[]``.
        hparams: the model's MoE parameters (gating, k, groups).

    A hash-routed next layer (DeepSeek-V4, ``MoEHParams.is_hash_layer``) chooses by token id, not by
    its router: the runner does not ask a predictor for it when the tokens' ids are known (it
    prefetches the table's experts, which are certain); asked anyway (the next token's first
    layers, whose id is not sampled yet), this predictor answers with that layer's router.

    Stateless: :meth:`observe` and :meth:`reset` do nothing. Cost per call: one
    ``(n_tokens, n_embd) x (n_embd, n_expert)`` product and a top-k.
    """

    name: ClassVar[str] = "router"
    stateless: ClassVar[bool] = True

    def __init__(self, residents: Mapping[int, ResidentLayer], hparams: MoEHParams) -> None:
        if not isinstance(hparams, MoEHParams):
            raise ConfigError(f"hparams must be a MoEHParams, got {type(hparams).__name__}")
        residents = dict(residents)
        for layer, resident in residents.items():
            if not isinstance(resident, ResidentLayer):
                raise ConfigError(f"residents[{layer}] must be a ResidentLayer, got {type(resident).__name__}")
            if resident.n_embd != hparams.n_embd:
                raise ConfigError(f"residents[{layer}] has n_embd={resident.n_embd}, hparams n_embd={hparams.n_embd}")
        self._residents: Mapping[int, ResidentLayer] = MappingProxyType(residents)
        self._hparams = hparams

    def observe(self, layer: int, x: np.ndarray | None, ids: np.ndarray) -> None:
        _check_ids(ids)

    def predict(self, layer: int, next_layer: int, x: np.ndarray | None, budget: int) -> list[int]:
        """See :meth:`Predictor.predict`.

        Raises:
            ConfigError: ``budget`` is negative.
            InvalidRequestError: ``x`` is not float32 ``(n_tokens, n_embd)`` (a ``(n_embd,)`` row is
                one token).
        """
        return self.predict_weighted(layer, next_layer, x, budget)[0]

    def predict_weighted(
        self, layer: int, next_layer: int, x: np.ndarray | None, budget: int
    ) -> tuple[list[int], dict[int, float]]:
        """:meth:`predict` and each predicted expert's routing weight as the next layer's router
        gives it for ``x`` (the largest over the rows that choose it).

        Raises:
            As :meth:`predict`.
        """
        budget = _check_budget(budget)
        resident = self._residents.get(next_layer)
        if resident is None or x is None or budget == 0:
            return [], {}
        if isinstance(x, np.ndarray) and x.ndim == 1:
            x = x[None, :]
        logits = router_logits(x, resident)
        if logits.shape[0] == 0:
            return [], {}
        ids, weights = select_experts(logits, self._hparams, resident.selection_bias)
        chosen = np.zeros(logits.shape, dtype=bool)
        np.put_along_axis(chosen, ids.astype(np.int64), True, axis=1)
        scores = _selection_scores(logits, self._hparams.gating_func, resident.selection_bias)
        votes = chosen.sum(axis=0)
        summed = np.where(chosen, scores, 0.0).sum(axis=0, dtype=np.float64)
        ranked = _rank(votes, summed, budget)
        gate = np.zeros(logits.shape[1], dtype=np.float64)
        with np.errstate(invalid="ignore"):  # a non-finite row is the forward pass's error, not a warning here
            np.maximum.at(gate, ids.astype(np.int64).ravel(), weights.astype(np.float64).ravel())
        return ranked, {e: float(gate[e]) for e in ranked}


def _selection_scores(logits: np.ndarray, gating: GatingFunc, bias: np.ndarray | None) -> np.ndarray:
    """Steps 1-2 of ``select_experts``: the scores whose top-k is taken (probs plus selection bias)."""
    if gating == GatingFunc.SOFTMAX:
        probs = softmax(logits)
    elif gating == GatingFunc.SIGMOID:
        probs = sigmoid(logits)
    elif gating == GatingFunc.SQRT_SOFTPLUS:
        probs = sqrt_softplus(logits)
    else:  # SOFTMAX_WEIGHT selects on the raw logits
        probs = logits
    return probs + bias if bias is not None else probs


class PreviousTokenPredictor(Predictor):
    """The experts the previous token chose at the next layer.

    "Previous token" is the last :meth:`observe` call for that layer (in decode: the previous token;
    after a prefill batch: every token of the batch). Ids are ordered by how many of that call's tokens
    chose them, ties by recency: the last token's experts first, in its router order (llama.cpp
    orders a token's ids by descending selection score), then those of the token before it, and so on.
    Inactive ``-1`` slots are ignored; a token choosing an expert twice counts once.

    A ``next_layer`` never observed yields ``[]`` (no fallback: a predictor that knows nothing
    prefetches nothing, rather than spend I/O on a guess; compose with another predictor if needed).
    """

    name: ClassVar[str] = "previous"

    def __init__(self) -> None:
        self._last: dict[int, list[int]] = {}

    def observe(self, layer: int, x: np.ndarray | None, ids: np.ndarray) -> None:
        ids = _check_ids(ids)
        if ids.shape[0] == 0:
            return
        chosen = _votes(ids)
        votes = chosen.sum(axis=0)
        recency = np.zeros(votes.shape[0], dtype=np.float64)  # larger: seen more recently
        position = 0
        for row in ids[::-1].tolist():  # last token first, its slots in router order
            for e in row:
                if e >= 0 and recency[e] == 0:
                    recency[e] = ids.size - position
                position += 1
        self._last[layer] = _rank(votes, recency, votes.shape[0])

    def predict(self, layer: int, next_layer: int, x: np.ndarray | None, budget: int) -> list[int]:
        budget = _check_budget(budget)
        return list(self._last.get(next_layer, ())[:budget])

    def reset(self) -> None:
        self._last.clear()


class FrequencyPredictor(Predictor):
    """The experts chosen most often so far at the next layer, with exponentially decayed counts.

    Per layer, each expert has a count. Observing ``n`` tokens multiplies every count of that layer by
    ``decay ** n`` and adds ``decay ** (n - 1 - i)`` for each expert token ``i`` chose (a token
    choosing an expert twice counts once, ``-1`` is ignored): the decay is per *token*, so one batch
    of ``n`` tokens and ``n`` single-token calls give the same counts. Experts are ranked by count,
    ties to the lower id; experts with a zero count are never predicted, so a ``next_layer`` never
    observed yields ``[]``.

    Args:
        decay: in ``(0, 1]``; 1 keeps plain counts. Default :data:`DEFAULT_FREQUENCY_DECAY` (0.99:
            half-life about 69 tokens, effective memory 100 tokens).

    Raises:
        ConfigError: ``decay`` is outside ``(0, 1]``.
    """

    name: ClassVar[str] = "frequency"

    def __init__(self, decay: float = DEFAULT_FREQUENCY_DECAY) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ConfigError(f"decay must be a number in (0, 1], got {decay!r}")
        self.decay = float(decay)
        self._counts: dict[int, np.ndarray] = {}

    def observe(self, layer: int, x: np.ndarray | None, ids: np.ndarray) -> None:
        ids = _check_ids(ids)
        n = ids.shape[0]
        if n == 0:
            return
        chosen = _votes(ids)
        weights = self.decay ** np.arange(n - 1, -1, -1, dtype=np.float64)
        added = weights @ chosen if chosen.shape[1] else np.zeros(0)
        counts = self._counts.get(layer, np.zeros(0))
        if counts.shape[0] < added.shape[0]:
            counts = np.concatenate([counts, np.zeros(added.shape[0] - counts.shape[0])])
        counts = counts * self.decay**n
        counts[: added.shape[0]] += added
        self._counts[layer] = counts

    def predict(self, layer: int, next_layer: int, x: np.ndarray | None, budget: int) -> list[int]:
        budget = _check_budget(budget)
        counts = self._counts.get(next_layer)
        if counts is None:
            return []
        return _rank(counts, None, budget)

    def counts(self, layer: int) -> np.ndarray:
        """The decayed counts of ``layer`` (a copy, float64, indexed by expert id; empty if unseen)."""
        return np.array(self._counts.get(layer, np.zeros(0)))

    def reset(self) -> None:
        self._counts.clear()


# --------------------------------------------------------------------------------------------------
# registry

PREDICTORS: Mapping[str, type[Predictor]] = MappingProxyType(
    {cls.name: cls for cls in (NextRouterPredictor, PreviousTokenPredictor, FrequencyPredictor, NullPredictor)}
)
"""Registry name -> predictor class: ``"router"``, ``"previous"``, ``"frequency"``, ``"none"``."""


def make_predictor(name: str, /, **options: Any) -> Predictor:
    """Build a predictor by registry name.

    Args:
        name: ``"router"`` (needs ``residents=`` and ``hparams=``), ``"previous"``, ``"frequency"``
            (optional ``decay=``) or ``"none"`` (a :class:`NullPredictor`: never predicts).
        **options: the constructor arguments of that predictor.

    Returns:
        A fresh predictor.

    Raises:
        ConfigError: the name is unknown (the message lists the known ones), an option is missing or
            unknown, or an option value is out of range.
    """
    cls = PREDICTORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"unknown predictor {name!r}; known: {', '.join(sorted(PREDICTORS))}")
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as exc:
        raise ConfigError(f"predictor {name!r}: {exc}") from None
    return cls(**options)
