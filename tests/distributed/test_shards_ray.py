"""Expert shards on a local Ray cluster: the same answers as the single-process runner, and failures.

Marked ``ray``: ``make test`` runs these in a second pass (``pytest -m ray``), with the ``ray`` extra.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import golden_fixture_paths, golden_tolerance, rel_l2

import aioexperts
from aioexperts.distributed import (
    ExpertShard,
    Placement,
    ShardedRunner,
    coactivation_placement,
    expert_shard_actor,
    round_robin_placement,
)
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = [pytest.mark.ray, pytest.mark.anyio, pytest.mark.timeout(240)]

FIXTURES = golden_fixture_paths()
THREADS = aioexperts.IOOptions(backend="threads")  # auto would probe io_uring in a child per shard
MAX_SHARDS = 3


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster (``ray.init(num_cpus=2)``) for the session; shut down at the end."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'aioexperts[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("asyncio", {})  # Ray's async API is asyncio's; uvloop has a test of its own below


@pytest.fixture(scope="module")
def shard_pool(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    """Three shard actors, started once and reopened on each fixture (an actor start costs seconds)."""
    path = tmp_path_factory.mktemp("seed") / "seed.gguf"
    write_synthetic_model(path, SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2))
    layout = aioexperts.build_layout(aioexperts.open_model(path))
    placement = round_robin_placement(layout, MAX_SHARDS, n_embd=256)
    actor = expert_shard_actor()
    handles = [actor.remote(str(path), placement, i, slots=8, io=THREADS) for i in range(MAX_SHARDS)]
    yield handles
    for h in handles:
        ray_cluster.kill(h)


async def _reopen(handles: list[Any], path: Path, placement: Placement) -> list[Any]:
    shards = handles[: placement.n_shards]
    await asyncio.gather(*(h.reopen.remote(str(path), placement, i, slots=8, io=THREADS) for i, h in enumerate(shards)))
    return shards


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
async def test_sharded_moe_equals_the_local_runner_bit_for_bit(
    path: Path, shard_pool: list[Any], anyio_backend: object
) -> None:
    """2 shards (round-robin) and 3 shards (co-activation from the goldens' routes): every MoE layer
    of every fixture gives the local runner's routing and, bit for bit, its outputs (top-2: each
    token adds at most two partials, in shard order); and llama.cpp's within the goldens' tolerance."""
    golden = np.load(path.with_suffix(".golden.npz"))
    async with aioexperts.open(path, slots=4, io=THREADS) as store:
        local = aioexperts.MoERunner(store)
        layers = [layer for layer in store.layout.layers if f"moe_in-{layer}" in golden and f"topk-{layer}" in golden]
        inputs = {layer: np.atleast_2d(golden[f"moe_in-{layer}"]).astype(np.float32) for layer in layers}
        want = {layer: await local.moe_result(layer, x) for layer, x in inputs.items()}
        trace = local_trace(store, want)
        n_embd = store.hparams.n_embd
        placements = [
            round_robin_placement(store.layout, 2, n_embd=n_embd),
            coactivation_placement(store.layout, trace, 3, n_embd=n_embd),
        ]
        for placement in placements:
            shards = await _reopen(shard_pool, path, placement)
            runner = ShardedRunner(store, shards, placement, call_timeout=60)
            expected_calls = 0
            for layer, x in inputs.items():
                got = await runner.moe_result(layer, x)
                ref = want[layer]
                np.testing.assert_array_equal(got.ids, ref.ids)
                np.testing.assert_array_equal(got.weights, ref.weights)
                np.testing.assert_array_equal(got.moe_out, ref.moe_out)
                np.testing.assert_array_equal(got.ffn_out, ref.ffn_out)
                assert rel_l2(got.moe_out, np.atleast_2d(golden[f"moe_out-{layer}"])) <= golden_tolerance(path)
                owners = placement.owner_of(layer)[ref.ids[ref.ids >= 0]]
                expected_calls += len(set(owners.tolist()))
            assert runner.calls == expected_calls  # one call per owner per layer, never per expert


def local_trace(store: aioexperts.ExpertStore, results: dict[int, aioexperts.MoEResult]) -> aioexperts.RoutingTrace:
    """The routes of every layer of every golden token, as a trace (absent rows -1)."""
    layout = store.layout
    n = max(len(r.ids) for r in results.values())
    ids = np.full((n, len(layout.layers), layout.n_expert_used), -1, dtype=np.int16)
    for i, layer in enumerate(layout.layers):
        if layer in results:
            got = results[layer].ids
            ids[: len(got), i] = got
    return aioexperts.RoutingTrace(ids, tuple(layout.layers), [m.n_experts for m in layout.layers.values()])


@pytest.fixture(scope="module")
def top4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A top-4 model: a token's experts spread over three shards add three partials, so order shows."""
    path = tmp_path_factory.mktemp("top4") / "top4.gguf"
    write_synthetic_model(path, SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=12, n_expert_used=4))
    return path


async def test_the_sum_does_not_depend_on_which_shard_answers_first(
    top4_model: Path, ray_cluster: Any, anyio_backend: object
) -> None:
    """Shard 0 answers last in one run, first in the other: the outputs are the same bits."""

    class DelayedShard(ExpertShard):
        def __init__(self, *args: Any, delay: float, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.delay = delay

        async def partial(self, *args: Any, **kwargs: Any) -> np.ndarray:
            await asyncio.sleep(self.delay)
            return await super().partial(*args, **kwargs)

    actor = ray_cluster.remote(num_cpus=0, max_restarts=0)(DelayedShard)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    async with aioexperts.open(top4_model, slots=8, io=THREADS) as store:
        placement = round_robin_placement(store.layout, 3, n_embd=256)
        outputs = []
        for delays in ((0.4, 0.2, 0.0), (0.0, 0.2, 0.4)):
            shards = [
                actor.remote(str(top4_model), placement, i, slots=12, io=THREADS, delay=d) for i, d in enumerate(delays)
            ]
            runner = ShardedRunner(store, shards, placement)
            result = await runner.moe_result(0, x)
            outputs.append(result.moe_out)
            spread = {len(set(placement.owner_of(0)[row].tolist())) for row in result.ids}
            assert 3 in spread  # some token really adds three partials
            for h in shards:
                ray_cluster.kill(h)
        np.testing.assert_array_equal(outputs[0], outputs[1])
        local = await aioexperts.MoERunner(store).moe_result(0, x)
        np.testing.assert_allclose(outputs[0], local.moe_out, rtol=1e-5, atol=1e-6)  # k=4: another sum order


async def test_a_killed_shard_fails_the_call_in_flight_and_the_next_one_succeeds(
    top4_model: Path, ray_cluster: Any, tmp_path: Path, anyio_backend: object
) -> None:
    """SIGKILL a shard while it holds a call: that call gets ShardError (the Ray error attached)
    at once; Ray restarts the actor (max_restarts) and the next call of the same runner succeeds."""

    class StallingShard(ExpertShard):
        """Holds its first call until killed, in its first life only (the marker file says)."""

        def __init__(self, *args: Any, marker: str | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.marker = marker

        async def pid(self) -> int:
            return os.getpid()

        async def partial(self, *args: Any, **kwargs: Any) -> np.ndarray:
            if self.marker is not None and not os.path.exists(self.marker):
                Path(self.marker).touch()
                await asyncio.sleep(3600)  # killed here
            return await super().partial(*args, **kwargs)

    actor = ray_cluster.remote(num_cpus=0, max_restarts=2, max_task_retries=0)(StallingShard)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    async with aioexperts.open(top4_model, slots=8, io=THREADS) as store:
        placement = round_robin_placement(store.layout, 2, n_embd=256)
        marker = str(tmp_path / "stalled")
        shards = [
            actor.remote(str(top4_model), placement, 0, slots=12, io=THREADS),
            actor.remote(str(top4_model), placement, 1, slots=12, io=THREADS, marker=marker),
        ]
        runner = ShardedRunner(store, shards, placement, call_timeout=60)
        want = await aioexperts.MoERunner(store).moe_result(0, x)
        await runner.warmup()
        pid = await shards[1].pid.remote()
        call = asyncio.ensure_future(runner.moe_result(0, x))
        await asyncio.sleep(1.0)
        assert not call.done()  # shard 1 holds it
        os.kill(pid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(aioexperts.ShardError) as caught:
            await call
        assert loop.time() - t0 < 30
        assert caught.value.shard == 1 and caught.value.__cause__ is not None
        assert isinstance(caught.value, aioexperts.ExpertReadError)
        again = await runner.moe_result(0, x)  # served by the restarted actor
        np.testing.assert_allclose(again.moe_out, want.moe_out, rtol=1e-5, atol=1e-6)
        assert await shards[1].pid.remote() != pid
        for h in shards:
            ray_cluster.kill(h)


async def test_a_shard_that_never_answers_times_out(top4_model: Path, ray_cluster: Any, anyio_backend: object) -> None:
    """No call waits forever: a stuck shard gives ShardTimeoutError (a TimeoutError) after call_timeout."""

    class StuckShard(ExpertShard):
        async def partial(self, *args: Any, **kwargs: Any) -> np.ndarray:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

    actor = ray_cluster.remote(num_cpus=0, max_restarts=0)(StuckShard)
    x = np.ones((2, 256), dtype=np.float32)
    async with aioexperts.open(top4_model, slots=8, io=THREADS) as store:
        placement = round_robin_placement(store.layout, 1, n_embd=256)
        shards = [actor.remote(str(top4_model), placement, 0, slots=12, io=THREADS)]
        runner = ShardedRunner(store, shards, placement, call_timeout=2.0)
        await runner.warmup()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(aioexperts.ShardTimeoutError) as caught:
            await asyncio.wait_for(runner.moe(0, x), 60)  # the outer bound only guards the test
        assert 1.9 <= loop.time() - t0 < 30
        assert isinstance(caught.value, TimeoutError) and caught.value.shard == 0
        ray_cluster.kill(shards[0])


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})], ids=["uvloop"])
async def test_a_shard_of_another_placement_is_refused_on_uvloop(
    top4_model: Path, ray_cluster: Any, anyio_backend: object
) -> None:
    """The runner asks each shard what it serves: a shard started with another placement is refused
    (PlacementError) before any layer runs; with the right ones the runner works on uvloop."""
    async with aioexperts.open(top4_model, slots=8, io=THREADS) as store:
        mine = round_robin_placement(store.layout, 2, n_embd=256)
        other = Placement(2, mine.layers, mine.n_experts, 256, tuple(1 - o for o in mine.owners))
        actor = expert_shard_actor(max_restarts=0)
        shards = [actor.remote(str(top4_model), other, i, slots=12, io=THREADS) for i in range(2)]
        runner = ShardedRunner(store, shards, mine)
        with pytest.raises(aioexperts.PlacementError, match="another placement"):
            await runner.moe(0, np.ones((1, 256), dtype=np.float32))
        swapped = ShardedRunner(store, shards[::-1], other)  # right placement, wrong order
        with pytest.raises(aioexperts.PlacementError, match="serves shard 1"):
            await swapped.warmup()
        good = ShardedRunner(store, shards, other)
        y = await good.moe(0, np.ones((1, 256), dtype=np.float32))
        want = await aioexperts.MoERunner(store).moe(0, np.ones((1, 256), dtype=np.float32))
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
        for h in shards:
            ray_cluster.kill(h)


async def test_the_whole_model_runs_on_shards(tiny_full_model: Path, ray_cluster: Any, anyio_backend: object) -> None:
    """``aioexperts.load(..., runner=ShardedRunner.factory(...))``: the same logits, bit for bit (top-2),
    and the same greedy continuation as the model on its local runner."""
    layout = aioexperts.build_layout(aioexperts.open_model(tiny_full_model))
    placement = round_robin_placement(layout, 2, n_embd=256)
    actor = expert_shard_actor(max_restarts=0)
    shards = [actor.remote(str(tiny_full_model), placement, i, slots=8, io=THREADS) for i in range(2)]
    prompt = [5, 17, 42, 99, 3]
    async with aioexperts.load(tiny_full_model, slots=8, io=THREADS, n_ctx=64) as local:
        want = await local.logits(prompt)
        want_tokens = [t async for t in local.generate(prompt, max_tokens=4)]
    factory = ShardedRunner.factory(shards, placement, call_timeout=60)
    async with aioexperts.load(tiny_full_model, slots=8, io=THREADS, n_ctx=64, runner=factory) as model:
        assert isinstance(model.runner, ShardedRunner)
        got = await model.logits(prompt)
        tokens = [t async for t in model.generate(prompt, max_tokens=4)]
        assert model.runner.calls > 0
    np.testing.assert_array_equal(got, want)
    assert tokens == want_tokens
    for h in shards:
        ray_cluster.kill(h)


async def _continuations(model: aioexperts.Model, prompts: list[list[int]], n_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation, the sequences decoding at once: even ones through
    ``generate``, odd ones through ``stream`` (its ``token_ids``)."""

    async def one(i: int, prompt: list[int]) -> list[int]:
        if i % 2 == 0:
            return [t async for t in model.generate(prompt, max_tokens=n_tokens, temperature=0.0)]
        stream = model.stream(prompt, max_tokens=n_tokens, temperature=0.0)
        async for _ in stream:
            pass
        return list(stream.token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


@pytest.mark.parametrize("n_shards", [2, 3])
@pytest.mark.parametrize("n_sequences", [1, 2, 4])
async def test_concurrent_sequences_compute_every_routed_expert_on_its_shard(
    tiny_full_model: Path, shard_pool: list[Any], n_shards: int, n_sequences: int, anyio_backend: object
) -> None:
    """Issue 32's shard defect: with two or more sequences decoding at once, the batched decode step
    read and computed the routed experts locally (8 of 24 shard calls made). Now the local store
    serves no routed expert at all, every shard computes, and each sequence's tokens are the local
    runner's (each alone)."""
    layout = aioexperts.build_layout(aioexperts.open_model(tiny_full_model))
    placement = round_robin_placement(layout, n_shards, n_embd=256)
    shards = await _reopen(shard_pool, tiny_full_model, placement)
    prompts = [[5, 17, 42, 99, 3], [7, 8], [200, 1, 300], [11, 12, 13, 14]][:n_sequences]
    async with aioexperts.load(tiny_full_model, slots=8, io=THREADS, n_ctx=64) as local:
        want = [[t async for t in local.generate(p, max_tokens=6, temperature=0.0)] for p in prompts]
    factory = ShardedRunner.factory(shards, placement, call_timeout=60)
    async with aioexperts.load(
        tiny_full_model, slots=8, io=THREADS, n_ctx=64, runner=factory, batch_wait=0.05
    ) as model:
        got = await _continuations(model, prompts, 6)
        local_store = model.store.statistics()
        batched = model.statistics().batched_steps
        runner_calls = model.runner.calls
    stats = await asyncio.gather(*(h.statistics.remote() for h in shards))
    assert got == want
    assert local_store.requests == 0 and local_store.bytes_read == 0, local_store  # nothing routed is local
    assert all(s["calls"] > 0 for s in stats), stats
    assert sum(s["calls"] for s in stats) == runner_calls
    if n_sequences > 1:
        assert batched > 0  # the batched decode step ran, and stayed on the shards
