"""The expert shard: a Ray actor that owns a share of the experts, reads them and computes them.

An :class:`ExpertShard` opens the model with its own store (slab, backend, eviction policy) and
serves only the experts the placement gives it. For one MoE layer and the rows of ``x`` routed to
its experts it returns the weighted sum of those experts' outputs (``(n_rows, n_embd)`` float32,
llama.cpp's ``build_moe_ffn`` restricted to the shard's experts); the experts never leave it.
The class is plain Python (importable without Ray); :func:`expert_shard_actor` makes it a Ray
actor class and :func:`start_shards` starts one actor per shard.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._cache.cache import Key
from .._compute.moe import ResidentLayer, moe_forward
from .._errors import ConfigError, InvalidRequestError, StoreClosedError
from .._executor import without_shared
from .._format.views import ExpertView
from .._pipeline import run_in_worker, run_layer_step
from .._runner import MoERunner, PrefetchOptions
from .._store import ExpertStore
from .._store import open as open_store
from ._ray import ray_module
from .placement import Placement

__all__ = ("DEFAULT_MAX_RESTARTS", "ExpertShard", "LayerCall", "expert_shard_actor", "start_shards")

DEFAULT_MAX_RESTARTS = 3
"""Restarts Ray gives a dead shard actor (:func:`start_shards`); its in-flight calls still fail."""

#: One layer's call to a shard: ``(layer, x_rows, ids, weights, prefetch keys, upcoming layers)``.
LayerCall = tuple[int, np.ndarray, np.ndarray, np.ndarray, Sequence[Key], Sequence[int]]


class ExpertShard:
    """One shard of a model's routed experts: its own store, only the experts it owns.

    Run it as a Ray actor (:func:`expert_shard_actor`, :func:`start_shards`); the methods are
    coroutines on the actor's event loop. The store opens on the first call (Ray runs
    ``__init__`` synchronously), and again after Ray restarts a dead actor.

    Args:
        path: the model file (every node needs the file, or the split set's shards with its experts).
        placement: the placement (a :class:`Placement`; shards and runner must share it).
        shard: this shard's index in ``placement``.
        store_options: keyword arguments of :func:`aioexperts.open` (``slots``, ``cache_bytes``,
            ``cache``, ``io``, ``mode``, ``pagecache``).

    Raises:
        ConfigError: ``shard`` out of range or ``placement`` not a :class:`Placement` (at once);
            PlacementError: the placement does not fit the model (on the first call).
    """

    def __init__(self, path: str | os.PathLike[str], placement: Placement, shard: int, **store_options: Any) -> None:
        if not isinstance(placement, Placement):
            raise ConfigError(f"placement must be an aioexperts.distributed.Placement, got {placement!r}")
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < placement.n_shards:
            raise ConfigError(f"shard must be an int in 0..{placement.n_shards - 1}, got {shard!r}")
        self._path = os.fspath(path)
        self._placement = placement
        self._shard = shard
        self._store_options = store_options
        self._store: ExpertStore | None = None
        self._residents: Mapping[int, ResidentLayer] = {}
        self._owned: dict[int, np.ndarray] = {}
        self._open_lock: asyncio.Lock | None = None
        self._calls = 0
        self._rows = 0
        self._seconds = 0.0

    async def _started(self) -> ExpertStore:
        if self._store is not None:
            return self._store
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self._store is None:
                store = open_store(self._path, **self._store_options)
                await store.start()
                try:
                    self._placement.check_model(store.layout, store.hparams.n_embd)
                    runner = MoERunner(store, prefetch=PrefetchOptions(depth=0))
                    await runner.warmup()  # kernels and resident biases/scales; routers unused here
                except BaseException:
                    await store.aclose()
                    raise
                self._residents = {layer: without_shared(r) for layer, r in runner.residents.items()}
                self._owned = {
                    layer: self._placement.owner_of(layer) == self._shard for layer in self._placement.layers
                }
                self._store = store
        return self._store

    async def describe(self) -> dict[str, Any]:
        """What this shard serves: ``shard``, ``placement`` (its fingerprint), ``model``, ``n_slots``,
        ``experts`` (owned, all layers), ``host``, ``pid``. Opens the store if needed.

        Raises:
            As :func:`aioexperts.open` and ``ExpertStore.start``; PlacementError.
        """
        store = await self._started()
        return {
            "shard": self._shard,
            "placement": self._placement.fingerprint(),
            "model": os.path.basename(self._path),
            "n_slots": store.n_slots,
            "experts": int(sum(int(m.sum()) for m in self._owned.values())),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    async def partial(
        self,
        layer: int,
        x: np.ndarray,
        ids: np.ndarray,
        weights: np.ndarray,
        prefetch: Sequence[Key] = (),
        upcoming: Sequence[int] = (),
    ) -> np.ndarray:
        """The weighted sum of this shard's experts for the rows ``x`` of MoE layer ``layer``.

        Args:
            layer: block index of a MoE layer.
            x: ``(n_rows, n_embd)`` float32, the MoE input rows routed here.
            ids: ``(n_rows, k)`` int32 expert ids, ``-1`` where the slot's expert is another shard's.
            weights: ``(n_rows, k)`` float32 routing weights (as the runner computed them).
            prefetch: ``(layer, expert)`` keys of upcoming layers this shard owns, to load ahead.
            upcoming: the layers still ahead (queued prefetches of other layers are dropped).

        Returns:
            ``(n_rows, n_embd)`` float32: ``sum over slots of weight * expert(x)`` for the slots whose
            expert is here, added in slot order (llama-graph.cpp ``build_moe_ffn``; the shared
            expert is the runner's).

        Raises:
            InvalidRequestError: an id this shard does not own, or shapes that do not fit.
            ExpertReadError, SlabExhaustedError, StoreClosedError: as ``ExpertStore.experts``.
        """
        store = await self._started()
        t0 = time.perf_counter()
        owned = self._owned.get(layer)
        if owned is None:
            raise InvalidRequestError(f"layer {layer} is not a MoE layer of {os.path.basename(self._path)}")
        if not isinstance(ids, np.ndarray) or ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise InvalidRequestError(f"ids must be a 2-D integer array, got {type(ids).__name__}")
        active = ids[ids >= 0]
        if active.size and (int(active.max()) >= owned.size or not owned[active].all()):
            stray = sorted({int(e) for e in active if e >= owned.size or not owned[e]})
            raise InvalidRequestError(
                f"shard {self._shard} does not own expert(s) {stray[:8]} of layer {layer}: is the runner's placement "
                "the shards' placement?"
            )
        experts = list(dict.fromkeys(active.tolist()))
        resident = self._residents[layer]
        hparams = store.hparams
        limit = store.n_slots
        if not experts:
            return np.zeros((len(x), hparams.n_embd), dtype=np.float32)
        groups = [experts[i : i + limit] for i in range(0, len(experts), limit)]
        prefetch_keys = [(int(a), int(b)) for a, b in prefetch]

        def compute(
            _layer: int, xx: np.ndarray, views: Mapping[int, ExpertView], ii: np.ndarray, ww: np.ndarray
        ) -> np.ndarray:
            with np.errstate(over="ignore", invalid="ignore"):  # the runner refuses non-finite sums
                return moe_forward(xx, ii, ww, views, resident, hparams).moe_out

        total: np.ndarray | None = None
        for g, group in enumerate(groups):
            group_ids = ids if len(groups) == 1 else np.where(np.isin(ids, group), ids, -1).astype(ids.dtype)
            step = await run_layer_step(
                store,
                layer,
                x,
                group_ids,
                weights,
                group,
                compute,
                prefetch=prefetch_keys if g == len(groups) - 1 else [],
                upcoming=upcoming,
            )
            total = step.output if total is None else await run_in_worker(np.add, total, step.output)
        assert total is not None
        self._calls += 1
        self._rows += len(x)
        self._seconds += time.perf_counter() - t0
        return total

    async def partial_layers(self, calls: Sequence[LayerCall]) -> list[np.ndarray]:
        """Several :meth:`partial` calls in one actor call, in order (independent layers' rows, e.g.
        several sequences' layers batched, or a bench of what batching saves)."""
        return [await self.partial(*call) for call in calls]

    async def statistics(self) -> dict[str, Any]:
        """This shard's counters: ``calls``, ``rows``, ``seconds`` (in :meth:`partial`) and its
        store's ``requests``, ``hits``, ``misses``, ``bytes_read``.

        Raises:
            StoreClosedError: the store is not open (no call yet, or closed).
        """
        if self._store is None:
            raise StoreClosedError(f"shard {self._shard}: the store is not open")
        st = self._store.statistics()
        return {
            "shard": self._shard,
            "calls": self._calls,
            "rows": self._rows,
            "seconds": self._seconds,
            "requests": st.requests,
            "hits": st.hits,
            "misses": st.misses,
            "bytes_read": st.bytes_read,
        }

    async def reopen(
        self, path: str | os.PathLike[str], placement: Placement, shard: int, **store_options: Any
    ) -> None:
        """Close the store and serve ``shard`` of ``placement`` over the model at ``path`` from the
        next call on (a new placement without restarting the cluster). A restarted actor goes back
        to its constructor's arguments.

        Raises:
            ConfigError: as the constructor.
        """
        old = self._store
        ExpertShard.__init__(self, path, placement, shard, **store_options)  # checks before closing
        if old is not None:
            await old.aclose()

    async def aclose(self) -> None:
        """Close the store (idempotent); a later call opens it again."""
        store, self._store = self._store, None
        if store is not None:
            await store.aclose()


def expert_shard_actor(**ray_options: Any) -> Any:
    """:class:`ExpertShard` as a Ray actor class (``ray.remote(**ray_options)(ExpertShard)``).

    Defaults: ``num_cpus=0`` (the shard's compute runs on its own bounded pool, not on Ray's CPU
    slots), ``max_restarts=DEFAULT_MAX_RESTARTS``, ``max_task_retries=0`` (a call in flight when the
    actor dies fails with :class:`~aioexperts.ShardError` instead of running twice).

    Raises:
        OptionalDependencyError: Ray is not installed.
    """
    ray = ray_module()
    options = {"num_cpus": 0, "max_restarts": DEFAULT_MAX_RESTARTS, "max_task_retries": 0, **ray_options}
    return ray.remote(**options)(ExpertShard)


def start_shards(
    path: str | os.PathLike[str],
    placement: Placement,
    *,
    spread: bool = True,
    ray_options: Mapping[str, Any] | None = None,
    **store_options: Any,
) -> list[Any]:
    """Start one :class:`ExpertShard` actor per shard of ``placement`` on the connected Ray cluster.

    Args:
        path: the model file, at this path on every node.
        placement: the placement; shard ``i`` is the ``i``-th handle.
        spread: Ray's ``"SPREAD"`` scheduling (one shard per node while there are nodes enough).
        ray_options: more options of :func:`expert_shard_actor` (``max_restarts``, ``resources``...).
        store_options: as :func:`aioexperts.open`, for every shard.

    Returns:
        The actor handles, in shard order (the stores open on the first call).

    Raises:
        OptionalDependencyError: Ray is not installed. ConfigError: a bad placement.
    """
    options = dict(ray_options or {})
    if spread:
        options.setdefault("scheduling_strategy", "SPREAD")
    actor = expert_shard_actor(**options)
    return [actor.remote(os.fspath(path), placement, i, **store_options) for i in range(placement.n_shards)]
