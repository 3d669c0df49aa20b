"""One MoE layer step of a token, and the driver that runs every MoE layer of a token.

A step: route (or take given ids), pin the layer's experts (their loads are queued), start the
prefetch of the next layer's predicted experts (after pinning, so it cannot evict them), wait for
the experts, then compute in a worker thread while the event loop keeps submitting and reaping
the prefetch reads. That is how layer N+1's reads overlap layer N's compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._cache.cache import Entry, ExpertCache, Key
from ._compute.pool import compute_pool
from ._format.views import ExpertView

__all__ = ("ComputeStep", "LayerStep", "TokenResult", "run_layer_step")

#: ``compute(layer, x, experts, ids, weights) -> y``, run in a worker thread: ``x`` is
#: ``(n_tokens, n_embd)`` float32, ``experts`` maps each active id to its pinned view, ``ids`` and
#: ``weights`` are ``(n_tokens, k)``; ``y`` is ``(n_tokens, n_embd)`` float32.
ComputeStep = Callable[[int, np.ndarray, Mapping[int, ExpertView], np.ndarray, np.ndarray], Any]


@dataclass(frozen=True, slots=True)
class LayerStep:
    """What one layer step did.

    Attributes:
        layer: block index.
        ids: ``(n_tokens, k)`` int32 selected ids.
        weights: ``(n_tokens, k)`` float32 routing weights.
        output: what the compute step returned (for :meth:`Engine.run_token`, a
            ``(n_tokens, n_embd)`` float32 array).
        io_wait_seconds: time spent waiting for this layer's experts after routing.
        compute_seconds: time the compute step ran on its compute-pool worker.
        prefetched: prefetch loads started for the next layer.
    """

    layer: int
    ids: np.ndarray
    weights: np.ndarray
    output: Any
    io_wait_seconds: float
    compute_seconds: float
    prefetched: int


@dataclass(frozen=True, slots=True)
class TokenResult:
    """One token (or batch) through every MoE layer.

    Attributes:
        output: the hidden state after the last MoE layer, ``(n_tokens, n_embd)`` float32.
        steps: per layer, in order.
        seconds: wall time of the whole token.
    """

    output: np.ndarray
    steps: tuple[LayerStep, ...]
    seconds: float

    @property
    def io_wait_seconds(self) -> float:
        """Time spent waiting for experts, summed over layers."""
        return sum(s.io_wait_seconds for s in self.steps)

    @property
    def compute_seconds(self) -> float:
        """Compute time, summed over layers."""
        return sum(s.compute_seconds for s in self.steps)


def _timed(compute: ComputeStep) -> Callable[..., tuple[Any, float]]:
    def run(*args: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        y = compute(*args)
        return y, time.perf_counter() - t0

    return run


async def run_layer_step(
    cache: ExpertCache,
    make_view: Callable[[Entry], ExpertView],
    layer: int,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    compute: ComputeStep,
    *,
    prefetch: Sequence[Key] = (),
    upcoming: Sequence[int] = (),
    wait: bool = False,
) -> LayerStep:
    """Pin ``layer``'s experts for ``ids``, prefetch ``prefetch``, wait, compute in a thread, unpin.

    Queued prefetches that are no longer wanted (this layer's that it does not use, and those of
    any layer that is not in ``upcoming``, the layers still ahead) are dropped before anything is
    submitted.

    Raises:
        InvalidRequestError, SlabExhaustedError, ExpertReadError, EngineClosedError: as
            :meth:`ExpertCache.acquire`.

    Cancellation handling:
        Cancelling unpins everything; reads already submitted complete in the background. A
        compute step already running in its thread finishes there (its result is discarded), and
        the experts stay pinned until it has finished, so their slots are not reused under it.
    """
    active = ids[ids >= 0]
    keys = [(layer, int(e)) for e in dict.fromkeys(active.tolist())]
    wanted = set(keys)
    ahead = set(upcoming) - {layer}
    cache.drop_prefetches(keep=lambda key: key in wanted or key[0] in ahead)
    started = 0

    def start_prefetch() -> None:
        nonlocal started
        if prefetch:
            started = cache.prefetch(prefetch)

    t0 = time.perf_counter()
    entries = await cache.acquire(keys, wait=wait, after_pin=start_prefetch)
    io_wait = time.perf_counter() - t0
    views = {entry.key[1]: make_view(entry) for entry in entries}
    try:
        # not abandoned on cancellation: the task waits for the worker, which reads the slots
        output, compute_s = await compute_pool().run(_timed(compute), layer, x, views, ids, weights)
    finally:
        for view in views.values():
            view.release()
        cache.release(entries)
    return LayerStep(layer, ids, weights, output, io_wait, compute_s, started)
