"""The per-token pipeline: prefetch of the next layers, dropping stale prefetches, chunked prefill,
and cancellation while the compute step runs."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import numpy as np
import pytest

import aioexperts
from aioexperts._predict.trace import uniform_random_trace
from aioexperts.testing import SyntheticSpec, write_synthetic_model
from aioexperts_bench import OraclePredictor

pytestmark = pytest.mark.anyio

SPEC = SyntheticSpec(n_layer=4, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2, leading_dense=1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipe") / "m.gguf"
    write_synthetic_model(path, SPEC)
    return path


async def test_layer_order_and_lookahead(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=8) as store:
        assert list(store.layout.layers) == [1, 2, 3, 4]
        one = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(depth=1))
        assert [one.upcoming_layers(layer) for layer in (1, 2, 3, 4)] == [[2], [3], [4], [1]]  # wraps to the next token
        assert aioexperts.MoERunner(store).upcoming_layers(3) == [4, 1]  # depth 2 by default
        deep = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(depth=9))
        assert deep.upcoming_layers(1) == [2, 3, 4]  # never the layer itself
        assert aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(depth=0)).upcoming_layers(1) == []
        with pytest.raises(aioexperts.InvalidRequestError):
            one.upcoming_layers(0)  # a dense block


def route_from(trace: aioexperts._predict.trace.RoutingTrace, token: list[int]):  # type: ignore[name-defined,no-untyped-def]
    def route(layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = trace.ids[token[0], trace.layer_index(layer)][None, :].astype(np.int32)
        return ids, np.full(ids.shape, 0.5, dtype=np.float32)

    return route


async def test_oracle_prefetch_turns_misses_into_prefetch_hits(model_path: Path, anyio_backend: object) -> None:
    trace = uniform_random_trace(6, [1, 2, 3, 4], 8, 2, seed=3)
    results = {}
    for prefetch in (False, True):
        async with aioexperts.open(model_path, slots=12) as store:
            runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
            token = [0]
            predictor = OraclePredictor(trace)
            x = np.full((1, 256), 0.01, dtype=np.float32)  # random weights: keep the residual small
            for t in range(trace.n_tokens):
                token[0] = predictor.token = t
                out = await runner.run_moe_layers(
                    x, route_step=route_from(trace, token), predictor=predictor, prefetch=prefetch
                )
                assert out.output.shape == (1, 256) and np.isfinite(out.output).all()
                assert [s.layer for s in out.steps] == [1, 2, 3, 4]
            results[prefetch] = (store.statistics(), runner.statistics())
    (off, off_run), (on, on_run) = results[False], results[True]
    assert off.prefetch_issued == 0 and off.misses > 0
    assert on.prefetch_issued > 0 and on.prefetch_hits > 0
    # the oracle is never wrong: everything it prefetched was used, nothing wasted
    assert on.prefetch_wasted == 0 and on.prefetch_hits + on.prefetch_dropped >= on.prefetch_issued - 4
    assert on.misses < off.misses
    assert on_run.tokens == off_run.tokens == 6 and on_run.token_latency_p50_ms is not None


async def test_prefetch_none_issues_nothing(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=12) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        await runner.run_moe_layers(np.full((1, 256), 0.01, dtype=np.float32))
        assert store.statistics().prefetch_issued == 0


async def test_run_token_is_the_deprecated_name_of_run_moe_layers(model_path: Path, anyio_backend: object) -> None:
    x = np.full((1, 256), 0.01, dtype=np.float32)
    async with aioexperts.open(model_path, slots=12) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        new = await runner.run_moe_layers(x)
        with pytest.warns(DeprecationWarning, match="run_moe_layers"):
            old = await runner.run_token(x, prefetch=False)
        assert isinstance(old, aioexperts.MoELayersResult)
        np.testing.assert_array_equal(old.output, new.output)


async def test_router_prefetch_with_the_real_executor(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=12) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="router"))
        rng = np.random.default_rng(0)
        for _ in range(3):
            await runner.run_moe_layers(0.01 * rng.standard_normal((1, 256)).astype(np.float32))
        st = store.statistics()
        assert st.prefetch_issued > 0 and st.requests == st.hits + st.inflight_joins + st.misses


async def test_prefill_larger_than_the_slab_runs_in_groups(model_path: Path, anyio_backend: object) -> None:
    x = 0.1 * np.random.default_rng(1).standard_normal((32, 256)).astype(np.float32)
    async with aioexperts.open(model_path, slots=64) as store:
        whole = await aioexperts.MoERunner(store).moe_result(2, x)
    assert len(np.unique(whole.ids)) > 3
    async with aioexperts.open(model_path, slots=3) as store:
        grouped = await aioexperts.MoERunner(store).moe_result(2, x)
        assert store.statistics().misses >= len(np.unique(whole.ids))
    np.testing.assert_array_equal(grouped.ids, whole.ids)
    np.testing.assert_allclose(grouped.ffn_out, whole.ffn_out, rtol=1e-5, atol=1e-6)


async def test_cancel_during_compute_keeps_slots_pinned_until_the_thread_ends(
    model_path: Path, anyio_backend: object
) -> None:
    started, finish = threading.Event(), threading.Event()

    def slow_compute(layer, x, views, ids, weights):  # type: ignore[no-untyped-def]
        started.set()
        finish.wait(10)
        return np.zeros_like(x)

    async with aioexperts.open(model_path, slots=8) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        done = anyio.Event()
        scope = anyio.CancelScope()
        cancelled = []

        async def token() -> None:
            with scope:
                try:
                    await runner.run_moe_layers(np.ones((1, 256), dtype=np.float32), compute=slow_compute)
                except anyio.get_cancelled_exc_class():
                    cancelled.append(True)
                    raise
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(token)
            with anyio.fail_after(5):
                while not started.is_set():
                    await anyio.sleep(0.005)
            scope.cancel()
            await anyio.sleep(0.05)
            assert not done.is_set()  # the task waits for its compute thread
            assert store.statistics().pinned_slots == 2  # and the experts stay pinned meanwhile
            finish.set()
            with anyio.fail_after(5):
                await done.wait()
        assert cancelled == [True]  # the cancellation was delivered, not turned into another error
        assert store.statistics().pinned_slots == 0


async def test_a_long_running_trace_stays_bounded(model_path: Path, anyio_backend: object) -> None:
    trace = uniform_random_trace(10, [1, 2, 3, 4], 8, 2, seed=5)
    async with aioexperts.open(model_path, slots=8) as store:
        runner = aioexperts.MoERunner(store, record_trace=True, trace_max_tokens=4)
        token = [0]
        for t in range(trace.n_tokens):
            token[0] = t
            await runner.run_moe_layers(np.full((1, 256), 0.01, dtype=np.float32), route_step=route_from(trace, token))
        recorded = runner.routing_trace()
    assert 1 <= recorded.n_tokens <= 4
    first = int(recorded.metadata["dropped_tokens"])
    assert first + recorded.n_tokens == 10
    np.testing.assert_array_equal(recorded.ids, trace.ids[first:])


async def test_concurrent_tokens_get_their_own_trace_rows(model_path: Path, anyio_backend: object) -> None:
    trace = uniform_random_trace(6, [1, 2, 3, 4], 8, 2, seed=7)
    results: dict[int, aioexperts.MoELayersResult] = {}
    async with aioexperts.open(model_path, slots=16) as store:
        runner = aioexperts.MoERunner(store, record_trace=True)

        async def token(t: int) -> None:
            results[t] = await runner.run_moe_layers(
                np.full((1, 256), 0.01, dtype=np.float32), route_step=route_from(trace, [t])
            )

        async with anyio.create_task_group() as tg:
            for t in range(6):
                tg.start_soon(token, t)
        recorded = runner.routing_trace()
    assert recorded.n_tokens == 6
    rows = {tuple(recorded.ids[r].reshape(-1)) for r in range(6)}
    wanted = {tuple(np.stack([s.ids[0] for s in results[t].steps]).reshape(-1)) for t in range(6)}
    assert rows == wanted  # every row is one whole token, never layers of different tokens


async def test_a_custom_compute_step_takes_one_pool_job_per_layer(model_path: Path, anyio_backend: object) -> None:
    """run_moe_layers hands the residual add and the next layer's route to the compute's job: one
    round trip between the loop and a worker per layer (plus the first route), not three; the
    result is the same residual stream, layer after layer."""
    from aioexperts._compute.pool import compute_pool

    trace = uniform_random_trace(2, [1, 2, 3, 4], 8, 2, seed=5)
    seen: list[tuple[int, float]] = []

    def compute(layer: int, x: np.ndarray, views: object, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        seen.append((layer, float(x[0, 0])))
        return np.full_like(x, layer)  # each layer adds its index to the stream

    async with aioexperts.open(model_path, slots=8) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        await runner.warmup()
        x = np.zeros((1, 256), dtype=np.float32)
        before = compute_pool().statistics().jobs
        result = await runner.run_moe_layers(x, route_step=route_from(trace, [0]), compute=compute)
        jobs = compute_pool().statistics().jobs - before
    assert jobs == 1 + 4
    assert seen == [(1, 0.0), (2, 1.0), (3, 3.0), (4, 6.0)]  # layer N sees the sum of the layers before it
    assert np.all(result.output == 10.0)
    assert [s.layer for s in result.steps] == [1, 2, 3, 4] and all(s.compute_seconds >= 0 for s in result.steps)
