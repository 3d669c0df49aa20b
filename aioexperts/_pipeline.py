"""One MoE layer step: pin the layer's experts, prefetch the next layers', compute in a worker.

A step pins the chosen experts (their loads are queued), starts the prefetch of the upcoming
layers' predicted experts right after pinning (so a prefetch cannot evict them), waits for the
experts, then computes in a worker thread while the event loop keeps submitting and reaping the
prefetch reads. That is how layer N+1's reads overlap layer N's compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ._cache.cache import Key
from ._compute.pool import compute_pool
from ._format.views import ExpertView
from ._store import ExpertStore

__all__ = ("ComputeStep", "LayerStep", "MoELayersResult", "run_in_worker", "run_layer_step", "run_layer_step_then")

#: ``compute(layer, x, experts, ids, weights) -> y``, run in a worker thread: ``x`` is
#: ``(n_tokens, n_embd)`` float32, ``experts`` maps each active id to its pinned view, ``ids`` and
#: ``weights`` are ``(n_tokens, k)`` (id ``-1``: inactive slot); ``y`` is ``(n_tokens, n_embd)``
#: float32.
ComputeStep = Callable[[int, np.ndarray, Mapping[int, ExpertView], np.ndarray, np.ndarray], Any]


@dataclass(frozen=True, slots=True)
class LayerStep:
    """What one layer step did.

    Attributes:
        layer: block index.
        ids: ``(n_tokens, k)`` int32 selected ids.
        weights: ``(n_tokens, k)`` float32 routing weights.
        output: what the compute step returned (for :meth:`MoERunner.run_moe_layers`, a
            ``(n_tokens, n_embd)`` float32 array).
        io_wait_seconds: time spent waiting for this layer's experts after routing.
        compute_seconds: time the compute step ran on its compute-pool worker.
    """

    layer: int
    ids: np.ndarray
    weights: np.ndarray
    output: Any
    io_wait_seconds: float
    compute_seconds: float


@dataclass(frozen=True, slots=True)
class MoELayersResult:
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


R = TypeVar("R")


async def run_in_worker(fn: Callable[..., R], *args: Any, spin: bool = False) -> R:
    """Run ``fn(*args)`` on the compute pool (sized to the cores, BLAS and OpenMP capped) and return its result.

    ``spin``: the pool's idle threads spin before sleeping while it runs (:class:`ComputePool`).

    Cancellation handling:
        A job still queued is dropped; one already running is waited for (it may read pinned
        slot memory), and the cancellation is delivered afterwards.
    """
    return await compute_pool().run(fn, *args, spin=spin)


def _timed(compute: ComputeStep, then: Callable[[Any], Any] | None = None) -> Callable[..., tuple[Any, float, Any]]:
    def run(*args: Any) -> tuple[Any, float, Any]:
        t0 = time.perf_counter()
        y = compute(*args)
        seconds = time.perf_counter() - t0
        return y, seconds, None if then is None else then(y)

    return run


async def run_layer_step(
    store: ExpertStore,
    layer: int,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    experts: Sequence[int],
    compute: ComputeStep,
    *,
    prefetch: Sequence[Key] = (),
    upcoming: Sequence[int] = (),
    wait: bool | None = None,
) -> LayerStep:
    """Pin ``experts`` (the distinct active ids of ``ids``), prefetch, wait, compute in a worker, unpin.

    Queued prefetches that are no longer wanted (this layer's that it does not use, and those of
    any layer that is not in ``upcoming``, the layers still ahead) are dropped before anything is
    submitted.

    Raises:
        InvalidRequestError, SlabExhaustedError, ExpertReadError, StoreClosedError: as
            :meth:`ExpertStore.experts`.

    Cancellation handling:
        Cancelling unpins everything; reads already submitted complete in the background. A
        compute step already running in its thread finishes there (its result is discarded), and
        the experts stay pinned until it has finished, so their slots are not reused under it.
    """
    _drop_unwanted(store, layer, experts, upcoming)
    t0 = time.perf_counter()
    async with store.experts(layer, experts, wait=wait, prefetch=prefetch) as views:
        io_wait = time.perf_counter() - t0
        by_id = {e: v for e, v in zip(experts, views, strict=True) if v is not None}
        output, compute_s, _ = await run_in_worker(_timed(compute), layer, x, by_id, ids, weights)
    return LayerStep(layer, ids, weights, output, io_wait, compute_s)


def _drop_unwanted(store: ExpertStore, layer: int, experts: Sequence[int], upcoming: Sequence[int]) -> None:
    """Drop the queued prefetches of this layer it does not use, and those of layers not ahead."""
    wanted = {(layer, e) for e in experts}
    ahead = set(upcoming) - {layer}
    store.drop_prefetches(keep=lambda key: key in wanted or key[0] in ahead)


async def run_layer_step_then(
    store: ExpertStore,
    layer: int,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    experts: Sequence[int],
    compute: ComputeStep,
    then: Callable[[Any], Any] | None,
    *,
    prefetch: Sequence[Key] = (),
    upcoming: Sequence[int] = (),
    wait: bool | None = None,
) -> tuple[LayerStep, Any]:
    """:func:`run_layer_step`, then ``then(output)`` in the same compute-pool job, right after the compute.

    One job instead of two saves a round trip between the event loop and a worker (two thread
    wake-ups) per layer: on a shared 2-core machine each wake-up can wait for a core. The
    ``compute_seconds`` of the step count the compute alone. What ``then`` raises is raised here.

    Returns:
        The step and what ``then`` returned (None without ``then``).

    Raises:
        As :func:`run_layer_step`, and whatever ``then`` raises.
    """
    _drop_unwanted(store, layer, experts, upcoming)
    t0 = time.perf_counter()
    async with store.experts(layer, experts, wait=wait, prefetch=prefetch) as views:
        io_wait = time.perf_counter() - t0
        by_id = {e: v for e, v in zip(experts, views, strict=True) if v is not None}
        output, compute_s, after = await run_in_worker(_timed(compute, then), layer, x, by_id, ids, weights)
    return LayerStep(layer, ids, weights, output, io_wait, compute_s), after
