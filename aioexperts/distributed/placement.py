"""Which shard owns which expert: a placement, its file, and three ways to make one from a trace.

A :class:`Placement` maps every ``(layer, expert)`` of a model's MoE layers to one of ``n_shards``
shards. It records what it was made for (the MoE layers, the experts of each, ``n_embd``), so a
shard or a runner given a placement of another model refuses it (:class:`~aioexperts.PlacementError`)
instead of computing a wrong answer. Needs no Ray.

The makers:

- :func:`round_robin_placement`: expert ``e`` of every layer on shard ``e % n_shards`` (no trace);
- :func:`frequency_balanced_placement`: per layer, experts in falling order of expected bytes
  (times chosen in the trace x the expert's bytes) each to the shard with the least expected bytes
  so far (longest-processing-time-first), so every shard serves about the same bytes per token;
- :func:`coactivation_placement`: per layer, experts that the trace's tokens choose together go
  to the same shard (greedy, by co-activation counts, under a load cap), so a token's top-k touch
  fewer shards and the runner makes fewer calls per token.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _json
from .._errors import ConfigError, FormatError, PlacementError
from .._format.layout import ExpertLayout
from .._predict.simulate import expert_frequencies
from .._predict.trace import RoutingTrace

__all__ = (
    "PLACEMENT_FORMAT",
    "PLACEMENT_METHODS",
    "Placement",
    "coactivation_placement",
    "frequency_balanced_placement",
    "make_placement",
    "round_robin_placement",
)

PLACEMENT_FORMAT = "aioexperts-placement/1"
"""The ``format`` field of a placement file (the only one read)."""

PLACEMENT_METHODS = ("round-robin", "frequency", "coactivation")
"""The names :func:`make_placement` accepts."""

_MAX_SHARDS = 1 << 12


@dataclass(frozen=True, eq=False, slots=True)
class Placement:
    """The owner shard of every routed expert, and the model it was made for.

    Attributes:
        n_shards: shards ``0..n_shards-1``.
        layers: the block indices of the model's MoE layers, increasing.
        n_experts: routed experts of each layer (as ``layers``).
        n_embd: the model's hidden size.
        owners: per layer (as ``layers``), an ``(n_experts,)`` int32 read-only array of shard indices.
        method: how it was made (``"round-robin"``, ``"frequency"``, ``"coactivation"``, or free text).
        metadata: free-form ``str -> str`` (model file name, trace, ...).

    Raises:
        ConfigError: inconsistent fields (an owner out of range, a wrong length).
    """

    n_shards: int
    layers: tuple[int, ...]
    n_experts: tuple[int, ...]
    n_embd: int
    owners: tuple[np.ndarray, ...]
    method: str = "custom"
    metadata: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        n = self.n_shards
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= _MAX_SHARDS:
            raise ConfigError(f"n_shards must be an int in 1..{_MAX_SHARDS}, got {n!r}")
        layers = tuple(int(v) for v in self.layers)
        n_experts = tuple(int(v) for v in self.n_experts)
        if not layers or len(n_experts) != len(layers) or len(self.owners) != len(layers):
            raise ConfigError(
                f"a placement needs one entry per MoE layer: {len(layers)} layers, {len(n_experts)} expert "
                f"counts, {len(self.owners)} owner lists"
            )
        if any(b <= a for a, b in zip(layers, layers[1:], strict=False)) or layers[0] < 0:
            raise ConfigError(f"layers must be non-negative and increasing, got {list(layers)}")
        owners = []
        for layer, count, row in zip(layers, n_experts, self.owners, strict=True):
            array = np.asarray(row)
            if array.shape != (count,) or (array.size and array.dtype.kind not in "iu"):
                raise ConfigError(f"layer {layer}: owners must be {count} ints, got {array.dtype} {array.shape}")
            if array.size and (int(array.min()) < 0 or int(array.max()) >= n):
                raise ConfigError(
                    f"layer {layer}: owners must be shards 0..{n - 1}, got {int(array.min())}..{int(array.max())}"
                )
            array = np.array(array, dtype=np.int32)
            array.flags.writeable = False
            owners.append(array)
        if isinstance(self.n_embd, bool) or not isinstance(self.n_embd, int) or self.n_embd < 1:
            raise ConfigError(f"n_embd must be a positive int, got {self.n_embd!r}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "n_experts", n_experts)
        object.__setattr__(self, "owners", tuple(owners))
        object.__setattr__(self, "metadata", dict(self.metadata or {}))

    # -- queries --------------------------------------------------------------------------------

    def owner_of(self, layer: int) -> np.ndarray:
        """``(n_experts,)`` int32: the shard of every expert of block ``layer``.

        Raises:
            PlacementError: ``layer`` is not a MoE layer of the placement.
        """
        try:
            return self.owners[self.layers.index(layer)]
        except ValueError:
            raise PlacementError(
                f"layer {layer} is not one of the placement's MoE layers {list(self.layers)}"
            ) from None

    def experts_of(self, shard: int) -> dict[int, list[int]]:
        """Block index -> the experts ``shard`` owns there (ascending)."""
        return {
            layer: np.flatnonzero(row == shard).tolist() for layer, row in zip(self.layers, self.owners, strict=True)
        }

    def counts(self) -> np.ndarray:
        """``(n_shards,)`` int64: experts owned by each shard, all layers together."""
        return np.bincount(np.concatenate(self.owners), minlength=self.n_shards).astype(np.int64)

    def fingerprint(self) -> tuple[Any, ...]:
        """What two placements must share to be the same: shards, layers, experts, ``n_embd``, owners."""
        return (self.n_shards, self.layers, self.n_experts, self.n_embd, tuple(o.tobytes() for o in self.owners))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and self.fingerprint() == other.fingerprint()

    __hash__ = None  # type: ignore[assignment]

    def check_model(self, layout: ExpertLayout, n_embd: int) -> None:
        """Refuse a model this placement was not made for.

        Args:
            layout: the model's expert layout (``store.layout``).
            n_embd: the model's hidden size (``store.hparams.n_embd``).

        Raises:
            PlacementError: the MoE layers, an expert count or ``n_embd`` differ (named in the message).
        """
        layers = tuple(layout.layers)
        if layers != self.layers:
            raise PlacementError(
                f"the placement is for MoE layers {_short(self.layers)}, the model has {_short(layers)}"
            )
        for layer, count in zip(self.layers, self.n_experts, strict=True):
            got = layout.layer(layer).n_experts
            if got != count:
                raise PlacementError(f"the placement gives layer {layer} {count} experts, the model has {got}")
        if n_embd != self.n_embd:
            raise PlacementError(f"the placement is for n_embd={self.n_embd}, the model has n_embd={n_embd}")

    # -- the file -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the placement file (see :meth:`save`)."""
        return {
            "format": PLACEMENT_FORMAT,
            "method": self.method,
            "n_shards": self.n_shards,
            "n_embd": self.n_embd,
            "layers": list(self.layers),
            "n_experts": list(self.n_experts),
            "owners": [o.tolist() for o in self.owners],
            "expert_counts": self.counts().tolist(),
            "metadata": dict(self.metadata or {}),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the placement as JSON (strict: ``aioexperts._json``), atomically (a rename).

        The object holds ``format`` (``"aioexperts-placement/1"``), ``method``, ``n_shards``,
        ``n_embd``, ``layers``, ``n_experts``, ``owners`` (one list of shard indices per layer),
        ``expert_counts`` (per shard, informative) and ``metadata``.

        Raises:
            OSError: the file cannot be written (one that cannot be created, in a missing or
                read-only folder, is named as ``path``, never as the temporary file beside it).
        """
        target = os.fspath(path)
        tmp = f"{target}.tmp-{os.getpid()}"
        try:
            try:
                f = open(tmp, "w", encoding="utf-8")
            except OSError as exc:  # name the user's path, not the temporary file's
                raise OSError(exc.errno, exc.strerror, target) from None
            with f:
                _json.dump(self.to_dict(), f, indent=1)
                f.write("\n")
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def from_dict(cls, data: object, *, name: str = "placement") -> Placement:
        """The placement of a parsed JSON object; nothing in it is trusted.

        Raises:
            FormatError: not a placement object of this format, or a field of the wrong kind
                (the message names ``name`` and the field).
        """
        if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise FormatError(f"{name}: not a placement file (format {got!r}, expected {PLACEMENT_FORMAT!r})")
        try:
            n_shards, n_embd = data["n_shards"], data["n_embd"]
            layers, n_experts, owners = data["layers"], data["n_experts"], data["owners"]
            method, metadata = data.get("method", "custom"), data.get("metadata") or {}
        except KeyError as exc:
            raise FormatError(f"{name}: the placement has no {exc.args[0]!r} field") from None
        ints = (layers, n_experts, *owners) if isinstance(owners, list) else ()
        if (
            not isinstance(owners, list)
            or not isinstance(layers, list)
            or not isinstance(n_experts, list)
            or any(not all(isinstance(v, int) and not isinstance(v, bool) for v in seq) for seq in ints)
            or not all(isinstance(o, list) for o in owners)
        ):
            raise FormatError(f"{name}: layers, n_experts and owners must be lists of ints")
        if not isinstance(method, str) or not isinstance(metadata, dict):
            raise FormatError(f"{name}: method must be a string and metadata an object")
        if any(len(o) > 1 << 20 for o in owners):
            raise FormatError(f"{name}: an owner list is longer than any model's layer")
        try:
            return cls(
                n_shards=n_shards,
                layers=tuple(layers),
                n_experts=tuple(n_experts),
                n_embd=n_embd,
                owners=tuple(np.asarray(o, dtype=np.int64) for o in owners),
                method=method,
                metadata={str(k): str(v) for k, v in metadata.items()},
            )
        except ConfigError as exc:
            raise FormatError(f"{name}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Placement:
        """Read a placement file written by :meth:`save`.

        Raises:
            FormatError: not valid JSON or not a valid placement (the message names the file).
            OSError: the file cannot be read.
        """
        import json

        name = os.fspath(path)
        with open(name, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise FormatError(f"{name}: not a JSON placement file: {exc}") from None
        return cls.from_dict(data, name=name)

    def __repr__(self) -> str:
        return (
            f"Placement({self.method}, n_shards={self.n_shards}, {len(self.layers)} MoE layers, "
            f"experts per shard {self.counts().tolist()})"
        )


def _short(values: Sequence[int]) -> str:
    shown = list(values[:6])
    return f"{shown}{' ...' if len(values) > 6 else ''} ({len(values)})"


def _check_shards(n_shards: object) -> int:
    if isinstance(n_shards, bool) or not isinstance(n_shards, int) or not 1 <= n_shards <= _MAX_SHARDS:
        raise ConfigError(f"n_shards must be an int in 1..{_MAX_SHARDS}, got {n_shards!r}")
    return n_shards


def _expert_bytes(layout: ExpertLayout | None, layer: int, n: int) -> np.ndarray:
    """``(n,)`` float64 bytes of each expert of ``layer`` (ones without a layout)."""
    if layout is None:
        return np.ones(n)
    return np.array([layout.locate(layer, e).n_bytes for e in range(n)], dtype=np.float64)


def _model_of(
    layout: ExpertLayout | None, trace: RoutingTrace | None, n_embd: int | None
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    if layout is not None:
        layers = tuple(layout.layers)
        n_experts = tuple(layout.layer(layer).n_experts for layer in layers)
        embd = n_embd if n_embd is not None else layout.layer(layers[0]).banks[0].n_embd
    elif trace is not None:
        if n_embd is None:
            raise ConfigError("without a layout, give n_embd")
        layers, n_experts, embd = trace.layers, trace.n_experts, n_embd
    else:
        raise ConfigError("give a layout (store.layout) or a trace")
    if trace is not None and (trace.layers != layers or trace.n_experts != n_experts):
        raise PlacementError(
            f"the trace is of MoE layers {_short(trace.layers)} with {_short(trace.n_experts)} experts, the model "
            f"of {_short(layers)} with {_short(n_experts)}"
        )
    return layers, n_experts, embd


def round_robin_placement(
    layout: ExpertLayout, n_shards: int, *, n_embd: int | None = None, metadata: Mapping[str, str] | None = None
) -> Placement:
    """Expert ``e`` of every MoE layer on shard ``(e + i) % n_shards`` (``i``: the layer's position),
    so that a layer with fewer experts than shards still spreads over all of them.

    Raises:
        ConfigError: ``n_shards`` out of range.
    """
    n = _check_shards(n_shards)
    layers, n_experts, embd = _model_of(layout, None, n_embd)
    owners = tuple((np.arange(count) + i) % n for i, count in enumerate(n_experts))
    return Placement(n, layers, n_experts, embd, owners, "round-robin", metadata)


def frequency_balanced_placement(
    layout: ExpertLayout,
    trace: RoutingTrace,
    n_shards: int,
    *,
    n_embd: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Placement:
    """Equal expected bytes per shard: per layer, longest-processing-time-first over the experts'
    expected bytes (``times chosen in trace x expert bytes``; never-chosen experts count one
    choice, so they still spread evenly). Ties go to the shard with the fewest bytes overall.

    Raises:
        ConfigError: ``n_shards`` out of range.
        PlacementError: the trace is of another model.
    """
    n = _check_shards(n_shards)
    layers, n_experts, embd = _model_of(layout, trace, n_embd)
    freq = expert_frequencies(trace)
    total = np.zeros(n)
    owners = []
    for layer, count in zip(layers, n_experts, strict=True):
        weight = np.maximum(freq[layer], 1).astype(np.float64) * _expert_bytes(layout, layer, count)
        load = np.zeros(n)
        row = np.zeros(count, dtype=np.int64)
        for e in np.lexsort((np.arange(count), -weight)):
            s = int(np.lexsort((np.arange(n), total, load))[0])  # least layer load, then least overall
            row[e] = s
            load[s] += weight[e]
            total[s] += weight[e]
        owners.append(row)
    return Placement(n, layers, n_experts, embd, tuple(owners), "frequency", metadata)


def coactivation_placement(
    layout: ExpertLayout,
    trace: RoutingTrace,
    n_shards: int,
    *,
    slack: float = 0.1,
    n_embd: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Placement:
    """Experts chosen together live together: fewer shards per token and layer, so fewer calls.

    Per layer, ``C[e, f]`` counts the trace's tokens choosing both ``e`` and ``f``. Experts are
    placed hottest first, each on the shard whose experts it was chosen with most often, among
    the shards whose expected bytes stay within ``(1 + slack)`` of an even share (so the load
    stays balanced); with no affinity anywhere, the least-loaded such shard.

    Args:
        slack: how far above an even share of expected bytes a shard may go, ``>= 0``.

    Raises:
        ConfigError: ``n_shards`` or ``slack`` out of range.
        PlacementError: the trace is of another model.
    """
    n = _check_shards(n_shards)
    if not isinstance(slack, int | float) or not np.isfinite(slack) or slack < 0:
        raise ConfigError(f"slack must be a finite number >= 0, got {slack!r}")
    layers, n_experts, embd = _model_of(layout, trace, n_embd)
    freq = expert_frequencies(trace)
    owners = []
    for i, (layer, count) in enumerate(zip(layers, n_experts, strict=True)):
        ids = trace.ids[:, i, :].astype(np.int64)
        chosen = np.zeros((len(ids), count), dtype=np.float64)
        rows = np.repeat(np.arange(len(ids)), ids.shape[1])
        flat = ids.reshape(-1)
        keep = flat >= 0
        chosen[rows[keep], flat[keep]] = 1.0
        co = chosen.T @ chosen  # (count, count) tokens choosing both
        np.fill_diagonal(co, 0.0)
        weight = np.maximum(freq[layer], 1).astype(np.float64) * _expert_bytes(layout, layer, count)
        cap = (1.0 + slack) * weight.sum() / n
        load = np.zeros(n)
        affinity = np.zeros((count, n))  # affinity[e, s] = sum of co[e, f] over f placed on s
        row = np.full(count, -1, dtype=np.int64)
        for e in np.lexsort((np.arange(count), -weight)):
            fits = load + weight[e] <= cap
            if not fits.any():
                fits = load == load.min()
            score = np.where(fits, affinity[e], -np.inf)
            best = np.flatnonzero(score == score.max())
            s = int(best[np.argmin(load[best])])
            row[e] = s
            load[s] += weight[e]
            affinity[:, s] += co[:, e]
        owners.append(row)
    return Placement(n, layers, n_experts, embd, tuple(owners), "coactivation", metadata)


def make_placement(
    method: str,
    layout: ExpertLayout,
    n_shards: int,
    trace: RoutingTrace | None = None,
    *,
    n_embd: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Placement:
    """The placement :data:`PLACEMENT_METHODS` names (``"frequency"`` and ``"coactivation"`` need ``trace``).

    Raises:
        ConfigError: an unknown method, or no trace for a method that needs one.
    """
    if method == "round-robin":
        return round_robin_placement(layout, n_shards, n_embd=n_embd, metadata=metadata)
    if method not in PLACEMENT_METHODS:
        raise ConfigError(f"unknown placement method {method!r}; one of {', '.join(PLACEMENT_METHODS)}")
    if trace is None:
        raise ConfigError(f"the {method!r} placement is made from a routing trace: give one")
    maker = frequency_balanced_placement if method == "frequency" else coactivation_placement
    return maker(layout, trace, n_shards, n_embd=n_embd, metadata=metadata)
