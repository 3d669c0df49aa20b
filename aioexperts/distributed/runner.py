"""The sharded runner: routes locally, computes the routed experts on their shards, sums in order.

:class:`ShardedRunner` is an :class:`~aioexperts.MoERunner` (``moe``, ``moe_result``,
``run_moe_layers``, the whole model through ``aioexperts.load(..., runner=...)``) whose routed
experts live on :class:`~aioexperts.distributed.ExpertShard` actors. Per MoE layer it routes with
the resident router, groups the selected experts by owner (the placement), sends **one call per
owner** with the rows routed there, computes the shared expert locally meanwhile, awaits the
calls together and adds the partial sums **in shard order**, so the result never depends on which
shard answers first. Every call has a deadline (``call_timeout``): a dead, stuck or unreachable
shard gives the waiting tokens a :class:`~aioexperts.ShardError` (cause attached), never a hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._batch import DEFAULT_BATCH_WAIT
from .._cache.cache import Key
from .._compute.moe import MoEOutput, moe_forward
from .._errors import AioExpertsError, ConfigError, PlacementError, ShardError, ShardTimeoutError
from .._executor import LayerExecutor, LayerOutcome, Then, check_finite
from .._pipeline import run_in_worker
from .._router import DEFAULT_TRACE_MAX_TOKENS, PrefetchOptions, Routing
from .._runner import MoERunner
from .._store import ExpertStore
from ._ray import ray_module
from .placement import Placement

__all__ = ("DEFAULT_CALL_TIMEOUT", "DEFAULT_OPEN_TIMEOUT", "ShardCall", "ShardExecutor", "ShardedRunner")

DEFAULT_CALL_TIMEOUT = 30.0
"""Seconds a layer waits for its shards (covers a restarted shard reopening its store)."""

DEFAULT_OPEN_TIMEOUT = 300.0
"""Seconds :meth:`ShardedRunner.warmup` waits for the shards to start and open their stores."""


@dataclass(frozen=True, slots=True)
class ShardCall:
    """The rows of one layer step that go to one shard.

    Attributes:
        shard: the shard index.
        rows: ``(n_rows,)`` int64 token rows of ``x`` (ascending) with an expert on this shard.
        x: ``(n_rows, n_embd)`` float32.
        ids: ``(n_rows, k)`` int32, the other shards' slots ``-1``.
        weights: ``(n_rows, k)`` float32.
        prefetch: keys of upcoming layers owned by this shard.
    """

    shard: int
    rows: np.ndarray
    x: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    prefetch: list[Key]


def split_by_owner(
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    owner: np.ndarray,
    n_shards: int,
    prefetch: Sequence[Key] = (),
    prefetch_owner: Callable[[Key], int] | None = None,
) -> list[ShardCall]:
    """The calls of one layer step, in shard order: each shard with at least one selected expert
    gets the rows that chose one of its experts (worker thread)."""
    shard_of = np.where(ids >= 0, owner[np.maximum(ids, 0)], -1)
    by_shard: dict[int, list[Key]] = {}
    if prefetch_owner is not None:
        for key in prefetch:
            by_shard.setdefault(prefetch_owner(key), []).append(key)
    calls = []
    for s in range(n_shards):
        mine = shard_of == s
        rows = np.flatnonzero(mine.any(axis=1))
        if not rows.size:
            continue
        calls.append(
            ShardCall(
                s,
                rows,
                np.ascontiguousarray(x[rows]),
                np.where(mine[rows], ids[rows], -1).astype(np.int32),
                np.ascontiguousarray(weights[rows]),
                by_shard.get(s, []),
            )
        )
    return calls


def sum_in_shard_order(n_rows: int, n_embd: int, calls: Sequence[ShardCall], parts: Sequence[np.ndarray]) -> np.ndarray:
    """``(n_rows, n_embd)`` float32: the partial sums added row by row in the order of ``calls``
    (shard order), whatever order they arrived in (worker thread)."""
    total = np.zeros((n_rows, n_embd), dtype=np.float32)
    for call, part in zip(calls, parts, strict=True):
        total[call.rows] += part
    return total


class ShardExecutor(LayerExecutor):
    """A :class:`~aioexperts._executor.LayerExecutor` whose routed experts are computed by remote shards.

    Per call it groups the selected experts by owner (the placement), sends **one call per
    owner** with the rows routed there (the predicted experts of the layers ahead travel with the
    call to their owner), computes the shared expert locally meanwhile, awaits the calls together
    and adds the partial sums **in shard order**. Several calls of one step (the rows of
    sequences decoding together) go as they would alone, concurrently, so each row's numbers are
    its lone ones. It reads nothing locally.

    Args:
        store: the local store (the shared experts' resident weights come through the router).
        shards: Ray actor handles of :class:`~aioexperts.distributed.ExpertShard`, shard ``i`` at
            index ``i``.
        placement: the placement the shards were started with.
        call_timeout: seconds a layer waits for its shards before :class:`~aioexperts.ShardTimeoutError`.
        open_timeout: seconds :meth:`warmup` waits for the shards to start and open their stores.

    Raises:
        ConfigError: a bad argument. PlacementError: the placement does not fit the model or the
            number of shards.
    """

    local = False

    def __init__(
        self,
        store: ExpertStore,
        shards: Sequence[Any],
        placement: Placement,
        *,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        open_timeout: float = DEFAULT_OPEN_TIMEOUT,
    ) -> None:
        super().__init__()
        if not isinstance(placement, Placement):
            raise ConfigError(f"placement must be an aioexperts.distributed.Placement, got {placement!r}")
        for name, value in (("call_timeout", call_timeout), ("open_timeout", open_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e6:
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        shards = list(shards)
        if len(shards) != placement.n_shards:
            raise PlacementError(
                f"the placement has {placement.n_shards} shards, {len(shards)} shard handles were given"
            )
        placement.check_model(store.layout, store.hparams.n_embd)
        self._store = store
        self.placement = placement
        self.call_timeout = float(call_timeout)
        self.open_timeout = float(open_timeout)
        self._shards = shards
        self._shards_checked = False
        self._shard_lock = asyncio.Lock()
        self._failed_at: dict[int, float] = {}  # shard -> when its last failure was seen (monotonic)
        self.calls = 0
        """Shard calls made so far (one per owner per call of a layer step)."""

    @property
    def shards(self) -> list[Any]:
        """The shard actor handles, in shard order."""
        return list(self._shards)

    async def warmup(self) -> None:
        """Once: ask every shard what it serves and refuse a shard of another placement or model;
        the shards open their stores now.

        Raises:
            ConfigError: not on asyncio (or uvloop).
            PlacementError: a shard's index or placement is not the runner's.
            ShardError, ShardTimeoutError: a shard did not answer.
        """
        _check_asyncio()
        if self._shards_checked:
            return
        async with self._shard_lock:
            if not self._shards_checked:
                answers = await self._gather(-1, [(i, "describe", ()) for i in range(len(self._shards))])
                mine = self.placement.fingerprint()
                for i, info in enumerate(answers):
                    if info["shard"] != i or info["placement"] != mine:
                        raise PlacementError(
                            f"shard handle {i} serves shard {info['shard']} of "
                            f"{'this' if info['placement'] == mine else 'another'} placement: start the shards "
                            "with the runner's placement, in shard order"
                        )
                self._shards_checked = True

    async def run(
        self,
        layer: int,
        calls: Sequence[Routing],
        prefetch: Sequence[Key] | None = None,
        then: Then | None = None,
    ) -> list[LayerOutcome]:
        _check_asyncio()
        calls = list(calls)
        if calls and prefetch:  # the step's read-ahead travels with the first call's shard calls
            calls[0] = dataclasses.replace(calls[0], prefetch=list(dict.fromkeys([*calls[0].prefetch, *prefetch])))
        outcomes: list[LayerOutcome]
        if len(calls) == 1:
            outcomes = [await self._one(layer, calls[0])]
        else:

            async def one(routing: Routing) -> LayerOutcome:
                try:
                    return await self._one(layer, routing)
                except AioExpertsError as exc:  # this call's own failure; the others go on
                    return exc

            outcomes = list(await asyncio.gather(*(one(c) for c in calls)))
        if then is not None:  # the sum ran in a job of its own; the caller's work in one more
            await run_in_worker(then, outcomes)
        return outcomes

    async def _one(self, layer: int, routed: Routing) -> tuple[MoEOutput, float, float]:
        """One call: split by owner, one shard call per owner, the shared expert here meanwhile, sum in order."""
        x = routed.x
        resident, hparams = self.router.residents[layer], self._store.hparams
        owner = self.placement.owner_of(layer)
        upcoming = self.router.upcoming_layers(layer)
        owners = {nxt: self.placement.owner_of(nxt) for nxt in upcoming}

        def owner_of_key(key: Key) -> int:
            return int(owners[key[0]][key[1]]) if key[0] in owners else -1

        calls: list[ShardCall] = await run_in_worker(
            split_by_owner,
            x,
            routed.ids,
            routed.weights,
            owner,
            self.placement.n_shards,
            routed.prefetch,
            owner_of_key,
        )
        requests = [(c.shard, "partial", (layer, c.x, c.ids, c.weights, c.prefetch, upcoming)) for c in calls]
        self.calls += len(requests)
        no_ids = np.full((len(x), 1), -1, dtype=np.int32)
        no_weights = np.zeros((len(x), 1), dtype=np.float32)

        def shared() -> tuple[np.ndarray | None, float]:
            t0 = time.perf_counter()
            if not resident.has_shared:
                return None, 0.0
            with np.errstate(over="ignore", invalid="ignore"):
                out = moe_forward(x, no_ids, no_weights, {}, resident, hparams).shared_out
            return out, time.perf_counter() - t0

        t0 = time.perf_counter()
        shared_task = asyncio.ensure_future(run_in_worker(shared))
        try:
            parts = await self._gather(layer, requests)
        except BaseException:
            await asyncio.gather(shared_task, return_exceptions=True)
            raise
        io_wait = time.perf_counter() - t0
        shared_out, compute_s = await shared_task

        def combine() -> MoEOutput:
            moe_out = sum_in_shard_order(len(x), hparams.n_embd, calls, parts)
            ffn_out = moe_out if shared_out is None else moe_out + shared_out
            check_finite(layer, ffn_out, x)
            return MoEOutput(moe_out, shared_out, ffn_out)

        out = await run_in_worker(combine)
        self.counters.add_step(io_wait, compute_s)
        return out, io_wait, compute_s

    async def _gather(self, layer: int, calls: Sequence[tuple[int, str, tuple[Any, ...]]]) -> list[Any]:
        """Run every ``(shard, method, args)`` call together within ``call_timeout``; results in the order given.

        A shard whose failure was seen already (its actor restarting) is waited for: a call sent
        after that point is sent again until the deadline. A call sent before, in flight when the
        actor died, fails with :class:`~aioexperts.ShardError`.
        """
        if not calls:
            return []
        ray = ray_module()
        loop = asyncio.get_running_loop()
        timeout = self.open_timeout if layer < 0 else self.call_timeout
        deadline = loop.time() + timeout
        where = "while opening" if layer < 0 else f"in layer {layer}"
        refs: dict[int, Any] = {}

        async def one(i: int, shard: int, method: str, args: tuple[Any, ...]) -> Any:
            sent = time.monotonic()
            pause = 0.05
            while True:
                refs[i] = getattr(self._shards[shard], method).remote(*args)
                try:
                    result = await asyncio.wrap_future(refs[i].future())
                except ray.exceptions.ActorUnavailableError as exc:
                    seen = self._failed_at.get(shard)
                    if seen is None or sent < seen:  # in flight when it died (or the first to see it)
                        self._failed_at[shard] = time.monotonic()
                        raise _shard_error(shard, where, exc) from exc
                    if loop.time() + pause >= deadline:
                        raise _shard_error(shard, where, exc) from exc
                    await asyncio.sleep(pause)  # restarting: send it again
                    pause = min(2 * pause, 0.5)
                    continue
                except ray.exceptions.RayError as exc:
                    if isinstance(exc, AioExpertsError):  # the shard refused or failed the request itself
                        cause = getattr(exc, "cause", None)
                        if isinstance(cause, AioExpertsError):
                            cause.add_note(f"raised by expert shard {shard} {where}")
                            raise cause from None
                        raise
                    self._failed_at[shard] = time.monotonic()
                    raise _shard_error(shard, where, exc) from exc
                self._failed_at.pop(shard, None)
                return result

        tasks = [asyncio.ensure_future(one(i, *call)) for i, call in enumerate(calls)]
        try:
            done, pending = await asyncio.wait(
                tasks, timeout=max(deadline - loop.time(), 0.0), return_when=asyncio.FIRST_EXCEPTION
            )
        except BaseException:
            pending = {t for t in tasks if not t.done()}
            _abandon(ray, pending, tasks, refs)
            raise
        failed = [t for t in tasks if t in done and t.exception() is not None]
        if failed or pending:
            _abandon(ray, pending, tasks, refs)
            if failed:
                exc = failed[0].exception()
                assert exc is not None
                raise exc
            shard = next(calls[i][0] for i, t in enumerate(tasks) if t in pending)
            raise ShardTimeoutError(
                f"expert shard {shard} did not answer {where} within "
                f"{'open' if layer < 0 else 'call'}_timeout={timeout:g} s",
                shard,
            )
        return [t.result() for t in tasks]

    def __repr__(self) -> str:
        return f"<aioexperts.distributed.ShardExecutor over {self.placement!r}>"


class ShardedRunner(MoERunner):
    """An :class:`~aioexperts.MoERunner` whose routed experts are computed by remote shards: the
    runner with a :class:`ShardExecutor` (every route from a token to the experts goes through
    it: one sequence, several decoding together, a prompt).

    Example::

        import asyncio
        import ray
        import aioexperts
        from aioexperts.distributed import ShardedRunner, round_robin_placement, start_shards
        from aioexperts.testing import builtin_model_path

        async def main() -> None:
            ray.init()                          # the cluster of this node, else a local one
            path = builtin_model_path()
            placement = round_robin_placement(aioexperts.build_layout(aioexperts.open_model(path)), 2)
            shards = start_shards(path, placement, slots=512)
            async with aioexperts.load(path, slots=8,
                                       runner=ShardedRunner.factory(shards, placement)) as model:
                print(await model.logits([1, 2, 3]))

        asyncio.run(main())

    Args:
        store: the local store of the model (routers, shared experts and the dense weights are read
            through it; its slab holds no routed expert, so a few slots do).
        shards, placement, call_timeout, open_timeout: as :class:`ShardExecutor`.
        prefetch, record_trace, trace_max_tokens, batch_wait: as :class:`~aioexperts.MoERunner`; the
            predicted experts of the upcoming layers travel with the layer's call to their owner (a
            shard with no call in this layer gets none).

    Raises:
        ConfigError: a bad argument. PlacementError: the placement does not fit the model or the
            number of shards (here), or a shard was started with another one (:meth:`warmup`).

    Event loops: asyncio and uvloop (Ray's async API is asyncio's); trio is refused with ConfigError.
    """

    def __init__(
        self,
        store: ExpertStore,
        shards: Sequence[Any],
        placement: Placement,
        *,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        open_timeout: float = DEFAULT_OPEN_TIMEOUT,
        prefetch: PrefetchOptions | None = None,
        record_trace: bool = False,
        trace_max_tokens: int = DEFAULT_TRACE_MAX_TOKENS,
        batch_wait: float | None = DEFAULT_BATCH_WAIT,
    ) -> None:
        executor = ShardExecutor(store, shards, placement, call_timeout=call_timeout, open_timeout=open_timeout)
        super().__init__(
            store,
            executor=executor,
            prefetch=prefetch,
            record_trace=record_trace,
            trace_max_tokens=trace_max_tokens,
            batch_wait=batch_wait,
        )
        self._shard_executor = executor

    @classmethod
    def factory(
        cls, shards: Sequence[Any], placement: Placement, **options: Any
    ) -> Callable[[ExpertStore, PrefetchOptions | None], ShardedRunner]:
        """A ``runner`` for :func:`aioexperts.load`: ``(store, prefetch) -> ShardedRunner``."""

        def make(store: ExpertStore, prefetch: PrefetchOptions | None) -> ShardedRunner:
            return cls(store, shards, placement, prefetch=prefetch, **options)

        return make

    @property
    def placement(self) -> Placement:
        """The placement the shards were started with."""
        return self._shard_executor.placement

    @property
    def shards(self) -> list[Any]:
        """The shard actor handles, in shard order."""
        return self._shard_executor.shards

    @property
    def calls(self) -> int:
        """Shard calls made so far (one per owner per call of a layer step)."""
        return self._shard_executor.calls

    @property
    def call_timeout(self) -> float:
        """Seconds a layer waits for its shards."""
        return self._shard_executor.call_timeout

    @property
    def open_timeout(self) -> float:
        """Seconds the warm-up waits for the shards to open."""
        return self._shard_executor.open_timeout

    def __repr__(self) -> str:
        return f"<aioexperts.distributed.ShardedRunner over {self._store!r}, {self.placement!r}>"


def _shard_error(shard: int, where: str, exc: BaseException) -> ShardError:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return ShardError(f"expert shard {shard} failed {where}: {type(exc).__name__}: {first}", shard)


def _abandon(ray: Any, pending: set[Any], tasks: Sequence[asyncio.Future[Any]], refs: dict[int, Any]) -> None:
    """Cancel the calls still running (best effort on the actors: they may be gone)."""
    for i, task in enumerate(tasks):
        if task in pending:
            task.cancel()
            ref = refs.get(i)
            if ref is not None:
                try:
                    ray.cancel(ref)
                except Exception:  # noqa: BLE001 - the actor may be gone already
                    pass
        elif task.done() and not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" warning


def _check_asyncio() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigError(
            "a ShardedRunner runs on asyncio (or uvloop): Ray's async calls are asyncio futures"
        ) from None
