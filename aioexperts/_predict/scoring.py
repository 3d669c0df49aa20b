"""Score next-layer predictors by replaying recorded routing, token by token.

Input format: a sequence of *steps*, one per token, in order. A step maps the block index of each MoE
layer the token went through to ``(x, ids)``:

- ``x``: that layer's MoE input for the token, ``(n_embd,)`` float32 (a ``(1, n_embd)`` row is
  accepted), or ``None`` when unknown;
- ``ids``: the experts the router selected, ``(k,)`` integers, ``-1`` for an inactive slot.

A layer missing from a step was not recorded for that token: nothing is observed there, and no
prediction *of* it is scored. Two adapters build steps:

- :func:`steps_from_arrays` from per-layer arrays, e.g. llama.cpp goldens (``moe_in-L``, ``topk-L``),
  where a layer with fewer rows holds the *last* tokens (llama.cpp computes only the rows it needs:
  the last layer of a golden has the last token only);
- :func:`steps_from_trace` from a :class:`~aioexperts._predict.trace.RoutingTrace`, which has no hidden
  states: it gives random ``x`` (standard normal) when asked for an ``n_embd``. Predictors that use
  ``x`` (the router predictor) are then guessing, and score about what a random guess would: the
  router predictor is only meaningful on real hidden states.

Replay (:func:`score_predictors`): every predictor is reset, then for each step and each recorded
layer ``N`` in ``layers`` order, ``observe(N, x, ids)`` (the runner observes right after routing),
then, when the next MoE layer ``N'`` of ``layers`` is recorded in the same step,
``predict(N, N', x, budget)`` is compared with the distinct active ids selected at ``N'``. This is
the decode case: one token per call.

Metrics are pooled over all scored predictions (micro averages): precision
``sum |pred & actual| / sum |pred|``, recall ``sum |pred & actual| / sum |actual|``; a predicted but
unused expert wastes its bytes (the bytes of one expert of ``N'``), a used one is useful, an unpredicted
one is missed (a demand read on the critical path).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from aioexperts._errors import ConfigError
from aioexperts._predict.predictors import Predictor
from aioexperts._predict.trace import RoutingTrace

__all__ = (
    "PredictorScore",
    "Step",
    "format_score_table",
    "random_guess_recall",
    "score_predictors",
    "steps_from_arrays",
    "steps_from_trace",
)

Step = Mapping[int, tuple["np.ndarray | None", np.ndarray]]
"""One token: MoE layer -> ``(x (n_embd,) float32 or None, ids (k,) int)``; see the module docstring."""


@dataclass(frozen=True, slots=True)
class PredictorScore:
    """How well one predictor did over a replay.

    Attributes:
        name: the predictor's :attr:`~aioexperts._predict.predictors.Predictor.name`.
        predictions: scored ``predict`` calls (one per token and pair of consecutive recorded layers).
        predicted: ids predicted, summed over those calls.
        actual: distinct active ids selected at the predicted layer, summed over those calls.
        hits: ids both predicted and selected, summed.
        useful_bytes: bytes of the predicted experts that were selected.
        wasted_bytes: bytes of the predicted experts that were not selected.
        missed_bytes: bytes of the selected experts that were not predicted.
    """

    name: str
    predictions: int
    predicted: int
    actual: int
    hits: int
    useful_bytes: int
    wasted_bytes: int
    missed_bytes: int

    @property
    def precision(self) -> float:
        """``hits / predicted``; NaN when nothing was predicted."""
        return self.hits / self.predicted if self.predicted else math.nan

    @property
    def recall(self) -> float:
        """``hits / actual``; NaN when nothing was selected."""
        return self.hits / self.actual if self.actual else math.nan


def random_guess_recall(budget: int, n_experts: int) -> float:
    """Expected recall of ``budget`` distinct experts guessed uniformly out of ``n_experts``.

    Each selected expert is among the guesses with probability ``min(budget, n_experts) / n_experts``,
    whatever the number selected; that is the line a predictor has to beat.
    """
    if n_experts <= 0:
        raise ConfigError(f"n_experts must be positive, got {n_experts}")
    return min(max(budget, 0), n_experts) / n_experts


def score_predictors(
    predictors: Iterable[Predictor],
    layers: Sequence[int],
    steps: Iterable[Step],
    bytes_per_expert: Mapping[int, int] | int,
    budget: int,
) -> dict[str, PredictorScore]:
    """Replay ``steps`` through every predictor and score their next-layer predictions.

    Args:
        predictors: the predictors; their names must be distinct. Each is :meth:`reset` first and
            left holding the state of the replay.
        layers: the MoE layers in forward order (block indices, strictly increasing); the "next
            layer" of ``layers[i]`` is ``layers[i + 1]``. Layers of a step not listed are ignored.
        steps: one step per token (see the module docstring); iterated once, so a generator works.
        bytes_per_expert: bytes of one expert (gate, up and down together) per layer, or one int
            for all; needed for every layer but the first.
        budget: the most ids a predictor may return per call, ``>= 0``.

    Returns:
        ``{predictor.name: PredictorScore}``, in the order of ``predictors``.

    Raises:
        ConfigError: duplicate predictor names, bad ``layers``/``budget``/``bytes_per_expert``, a
            malformed step, or a predictor that breaks its contract (more than ``budget`` ids,
            duplicates, negative ids).
    """
    predictors = list(predictors)
    names = [p.name for p in predictors]
    if len(set(names)) != len(names):
        raise ConfigError(f"predictor names must be distinct, got {names}")
    layers = tuple(int(layer) for layer in layers)
    if not layers or any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
        raise ConfigError(f"layers must be a non-empty strictly increasing sequence, got {list(layers)}")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ConfigError(f"budget must be a non-negative int, got {budget!r}")
    sizes = _layer_bytes(bytes_per_expert, layers[1:])
    following = dict(zip(layers, layers[1:], strict=False))
    wanted = frozenset(layers)

    counts = {name: [0] * 7 for name in names}  # predictions predicted actual hits useful wasted missed
    for p in predictors:
        p.reset()
    for t, step in enumerate(steps):
        parsed = {layer: _parse(t, layer, entry) for layer, entry in step.items() if layer in wanted}
        for layer in layers:
            here = parsed.get(layer)
            if here is None:
                continue
            x, ids = here
            for p in predictors:
                p.observe(layer, x, ids)
            nxt = following.get(layer)
            if nxt is None or nxt not in parsed:
                continue
            nxt_ids = parsed[nxt][1]
            actual = {int(e) for e in nxt_ids.reshape(-1) if e >= 0}
            size = sizes[nxt]
            for p in predictors:
                pred = p.predict(layer, nxt, x, int(budget))
                _check_prediction(p, pred, int(budget), t, layer, nxt)
                hits = len(actual.intersection(pred))
                c = counts[p.name]
                c[0] += 1
                c[1] += len(pred)
                c[2] += len(actual)
                c[3] += hits
                c[4] += hits * size
                c[5] += (len(pred) - hits) * size
                c[6] += (len(actual) - hits) * size
    return {name: PredictorScore(name, *counts[name]) for name in names}


def format_score_table(scores: Mapping[str, PredictorScore] | Iterable[PredictorScore]) -> str:
    """A plain-text table, one row per predictor: counts, precision, recall and bytes.

    Precision or recall that is undefined (nothing predicted or selected) shows as ``-``.
    """
    rows = list(scores.values()) if isinstance(scores, Mapping) else list(scores)
    header = (
        "predictor", "predictions", "predicted", "hits", "precision", "recall",
        "useful B", "wasted B", "missed B",
    )  # fmt: skip

    def ratio(v: float) -> str:
        return "-" if math.isnan(v) else f"{v:.3f}"

    body = [
        (
            s.name,
            str(s.predictions),
            str(s.predicted),
            str(s.hits),
            ratio(s.precision),
            ratio(s.recall),
            str(s.useful_bytes),
            str(s.wasted_bytes),
            str(s.missed_bytes),
        )
        for s in rows
    ]
    widths = [max(len(r[i]) for r in (header, *body)) for i in range(len(header))]
    lines = []
    for r in (header, *body):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# adapters


def steps_from_arrays(
    ids: Mapping[int, np.ndarray],
    xs: Mapping[int, np.ndarray] | None = None,
    *,
    n_tokens: int | None = None,
) -> list[Step]:
    """Steps from per-layer arrays, such as the llama.cpp goldens.

    Args:
        ids: layer -> ``(n_l, k)`` selected ids (a ``(k,)`` array is one token). The ``n_l`` rows are
            the *last* ``n_l`` of the ``n_tokens`` tokens: llama.cpp computes only the rows it needs,
            so a golden's last layer holds the last token alone.
        xs: layer -> ``(n_l, n_embd)`` float32 MoE inputs with the same rows as ``ids[layer]``
            (``(n_embd,)``: one token); a layer absent here gets ``x = None``.
        n_tokens: the sequence length; default the largest ``n_l``.

    Returns:
        ``n_tokens`` steps; token ``t`` holds the layers whose rows cover it.

    Raises:
        ConfigError: an array has the wrong shape, ``xs`` names a layer ``ids`` does not, rows
            disagree, or a layer has more rows than ``n_tokens``.
    """
    id_arrays = {int(layer): np.atleast_2d(np.asarray(a)) for layer, a in ids.items()}
    x_arrays = {int(layer): np.atleast_2d(np.asarray(a)) for layer, a in (xs or {}).items()}
    extra = sorted(set(x_arrays) - set(id_arrays))
    if extra:
        raise ConfigError(f"xs has layers {extra} that ids does not have")
    for layer, a in id_arrays.items():
        if a.ndim != 2 or (a.size and a.dtype.kind not in "iu"):
            raise ConfigError(f"ids[{layer}] must be integers of shape (n, k), got {a.dtype} {a.shape}")
        x = x_arrays.get(layer)
        if x is not None and (x.ndim != 2 or x.dtype != np.float32 or x.shape[0] != a.shape[0]):
            raise ConfigError(
                f"xs[{layer}] must be float32 of shape ({a.shape[0]}, n_embd) like ids[{layer}], "
                f"got {x.dtype} {x.shape}"
            )
    longest = max((a.shape[0] for a in id_arrays.values()), default=0)
    n = longest if n_tokens is None else int(n_tokens)
    if n < longest:
        raise ConfigError(f"n_tokens={n} but a layer has {longest} rows")
    steps: list[Step] = [{} for _ in range(n)]
    for layer in sorted(id_arrays):
        a = id_arrays[layer]
        x = x_arrays.get(layer)
        first = n - a.shape[0]
        for row in range(a.shape[0]):
            steps[first + row][layer] = (None if x is None else x[row], a[row])
    return steps


def steps_from_trace(trace: RoutingTrace, *, n_embd: int | None = None, seed: int = 0) -> Iterator[Step]:
    """Steps from a routing trace (lazily, one token at a time).

    A trace records ids only. With ``n_embd``, every ``(token, layer)`` gets a fresh standard-normal
    float32 ``x`` drawn from ``numpy.random.default_rng(seed)`` (deterministic); without it, ``x`` is
    None. Random ``x`` only keeps predictors that need one running: the router predictor's score on
    it is meaningless (about a random guess). Rows that are all ``-1`` (not recorded) are left out.

    Raises:
        ConfigError: ``n_embd`` is not a positive int.
    """
    if n_embd is not None and (isinstance(n_embd, bool) or not isinstance(n_embd, int) or n_embd < 1):
        raise ConfigError(f"n_embd must be a positive int or None, got {n_embd!r}")
    rng = np.random.default_rng(seed)
    ids = trace.ids
    recorded = np.asarray((ids >= 0).any(axis=2))
    for t in range(trace.n_tokens):
        xs = rng.standard_normal((trace.n_layers, n_embd), dtype=np.float32) if n_embd else None
        yield {
            layer: (None if xs is None else xs[i], ids[t, i]) for i, layer in enumerate(trace.layers) if recorded[t, i]
        }


# --------------------------------------------------------------------------------------------------
# helpers


def _layer_bytes(bytes_per_expert: Mapping[int, int] | int, layers: Sequence[int]) -> dict[int, int]:
    if isinstance(bytes_per_expert, Mapping):
        missing = [layer for layer in layers if layer not in bytes_per_expert]
        if missing:
            raise ConfigError(f"bytes_per_expert has no entry for layer(s) {missing}")
        sizes = {layer: bytes_per_expert[layer] for layer in layers}
    else:
        sizes = dict.fromkeys(layers, bytes_per_expert)
    for layer, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ConfigError(f"bytes_per_expert of layer {layer} must be a non-negative int, got {size!r}")
    return {layer: int(size) for layer, size in sizes.items()}


def _parse(t: int, layer: int, entry: object) -> tuple[np.ndarray | None, np.ndarray]:
    """``(x (1, n_embd) float32 | None, ids (1, k) int)`` from one step entry."""
    if not isinstance(entry, tuple) or len(entry) != 2:
        raise ConfigError(f"token {t}, layer {layer}: a step entry must be a tuple (x, ids), got {entry!r}")
    x, ids = entry
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[0] != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ConfigError(f"token {t}, layer {layer}: ids must be integers of shape (k,), got {ids.dtype} {ids.shape}")
    if x is not None:
        x = np.asarray(x)
        if x.ndim == 1:
            x = x[None, :]
        if x.ndim != 2 or x.shape[0] != 1 or x.dtype != np.float32:
            raise ConfigError(
                f"token {t}, layer {layer}: x must be float32 of shape (n_embd,), got {x.dtype} {x.shape}"
            )
    return x, ids


def _check_prediction(p: Predictor, pred: object, budget: int, t: int, layer: int, nxt: int) -> None:
    if (
        not isinstance(pred, list)
        or len(pred) > budget
        or len(set(pred)) != len(pred)
        or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in pred)
    ):
        raise ConfigError(
            f"predictor {p.name!r} broke its contract at token {t}, layer {layer} -> {nxt}: expected at most "
            f"{budget} distinct non-negative int ids, got {pred!r}"
        )
