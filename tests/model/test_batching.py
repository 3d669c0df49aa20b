"""Cross-request expert batching and hits-first: each sequence's numbers are those it gets alone."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import anyio
import numpy as np
import pytest
from conftest import shared_fixture_paths

import aioexperts
from aioexperts._batch import LayerBatcher
from aioexperts._compute import moe as moe_module
from aioexperts._compute.pool import compute_pool
from aioexperts._errors import ConfigError
from aioexperts._executor import batch_prefetch, hits_first_pays
from aioexperts._model.steps import StepBatcher
from aioexperts.testing import FakeBackend
from aioexperts.testing._full_model import FullModelSpec, write_full_model

pytestmark = pytest.mark.anyio

THREADS = aioexperts.IOOptions(backend="threads")
SMALL = FullModelSpec(
    n_layer=3,
    n_embd=256,
    n_head=4,
    n_head_kv=2,
    head_dim=64,
    n_expert=16,
    n_expert_used=4,
    n_ff_exp=256,
    vocab_size=600,
)
PROMPTS = [[5, 17, 300, 42], [9, 8, 7], [400, 12, 13, 14, 15], [77, 1]]
DECODE_STEPS = 5
FIXTURE = next((p for p in shared_fixture_paths() if p.stem == "qwen3moe-q4_k_m"), None)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_full_model(tmp_path_factory.mktemp("batch") / "small.gguf", SMALL)


async def _decode(model: aioexperts.Model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode through ModelSequence.forward, keeping every step's logits."""
    async with model.sequence() as seq:
        logits = (await seq.forward(prompt, all_logits=False))[0]
        tokens, seen = [], [logits]
        for _ in range(steps):
            tokens.append(int(np.argmax(logits)))
            logits = (await seq.forward(tokens[-1:], all_logits=False))[0]
            seen.append(logits)
        return tokens, seen


async def _alone(path: Path, prompts: list[list[int]], steps: int, **kw: object) -> list[tuple[list[int], list]]:
    async with aioexperts.load(path, batch_wait=0, hits_first=False, **kw) as model:  # type: ignore[arg-type]
        return [await _decode(model, p, steps) for p in prompts]


async def _together(
    path: Path, prompts: list[list[int]], steps: int, **kw: object
) -> tuple[list[tuple[list[int], list]], aioexperts.RunnerStatistics]:
    got: dict[int, tuple[list[int], list]] = {}
    async with aioexperts.load(path, batch_wait=1.0, **kw) as model:  # type: ignore[arg-type]

        async def one(i: int) -> None:
            got[i] = await _decode(model, prompts[i], steps)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return [got[i] for i in range(len(prompts))], model.runner.statistics()


def _assert_bit_equal(alone: list[tuple[list[int], list]], together: list[tuple[list[int], list]]) -> None:
    for i, ((tokens_a, logits_a), (tokens_b, logits_b)) in enumerate(zip(alone, together, strict=True)):
        assert tokens_a == tokens_b, f"sequence {i}"
        for step, (a, b) in enumerate(zip(logits_a, logits_b, strict=True)):
            assert a.tobytes() == b.tobytes(), f"sequence {i}, step {step}: max diff {np.abs(a - b).max()}"


@pytest.mark.parametrize("n_streams", [2, 4])
async def test_concurrent_sequences_batched_are_bit_equal_to_alone(
    small_model: Path, n_streams: int, anyio_backend: object
) -> None:
    prompts = PROMPTS[:n_streams]
    alone = await _alone(small_model, prompts, DECODE_STEPS, slots=64, io=THREADS)
    together, st = await _together(small_model, prompts, DECODE_STEPS, slots=64, io=THREADS)
    _assert_bit_equal(alone, together)
    # the batches did form: steps that served several sequences, with their rows
    assert st.batches > 0 and st.batched_calls >= 2 * st.batches
    assert st.retried_calls == 0
    assert st.rows_per_step is not None and st.rows_per_step > 1


@pytest.mark.skipif(FIXTURE is None, reason="shared fixtures not found")
async def test_batched_fixture_sequences_are_bit_equal_to_alone(anyio_backend: object) -> None:
    assert FIXTURE is not None
    forward = np.load(FIXTURE.with_name(FIXTURE.stem + ".forward.npz"))
    tokens = forward["tokens"].tolist()
    prompts = [tokens, tokens[::-1], tokens[3:11]]
    alone = await _alone(FIXTURE, prompts, 6, slots=64, io=THREADS)
    together, st = await _together(FIXTURE, prompts, 6, slots=64, io=THREADS)
    _assert_bit_equal(alone, together)
    assert st.batches > 0


async def test_batching_off_and_bad_options(small_model: Path, anyio_backend: object) -> None:
    for bad in (-1, "0.1", True, 11):
        with pytest.raises(aioexperts.ConfigError, match="batch_wait"):
            aioexperts.load(small_model, batch_wait=bad)  # type: ignore[arg-type]
    with pytest.raises(aioexperts.ConfigError, match="hits_first"):
        aioexperts.load(small_model, hits_first=1)  # type: ignore[arg-type]
    for off in (0, None):
        async with aioexperts.load(small_model, slots=64, io=THREADS, batch_wait=off) as model:
            assert not model.runner.batching
            with pytest.raises(aioexperts.ConfigError, match="batching is off"):
                model.runner.decode_stream()
            _, st = await _decode(model, PROMPTS[0], 1), model.runner.statistics()
            assert st.batches == 0 and st.experts_per_step is not None


async def test_a_lone_stream_never_waits(small_model: Path, anyio_backend: object) -> None:
    async with aioexperts.load(small_model, slots=64, io=THREADS, batch_wait=5.0) as model:
        with anyio.fail_after(20):  # a 5 s window per layer would take 3 layers * 5 s * 3 steps
            await _decode(model, PROMPTS[0], 2)
        st = model.runner.statistics()
        assert st.batches == 0 and st.batch_window_seconds < 1.0


# -- the runner: cancellation and errors in a batch -----------------------------------------------


def _fake(made: list[FakeBackend]):  # type: ignore[no-untyped-def]
    def factory(files, slab, loop, depth):  # type: ignore[no-untyped-def]
        made.append(FakeBackend(files, slab, loop, depth, auto=False))
        return made[-1]

    return factory


def _inputs(n: int, n_embd: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal((1, n_embd)).astype(np.float32) for _ in range(n)]


async def _reference(path: Path, layer: int, xs: list[np.ndarray]) -> list[np.ndarray]:
    async with aioexperts.open(path, slots=64, io=THREADS) as store:
        runner = aioexperts.MoERunner(store, batch_wait=0, hits_first=False)
        return [await runner.moe(layer, x) for x in xs]


async def _until(condition) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(20):
        while not condition():
            await anyio.sleep(0.005)


@pytest.mark.parametrize("victim", [0, 1])  # 0: the batch's leader (first to arrive), 1: a member
async def test_a_caller_cancelled_mid_batch_leaves_the_others_results(
    small_model: Path, victim: int, anyio_backend: object
) -> None:
    xs = _inputs(3, SMALL.n_embd)
    want = await _reference(small_model, 0, xs)
    made: list[FakeBackend] = []
    io = aioexperts.IOOptions(backend=_fake(made))
    async with aioexperts.open(small_model, slots=64, io=io) as store:
        runner = aioexperts.MoERunner(store, batch_wait=5.0, prefetch=aioexperts.PrefetchOptions(depth=0))
        await runner.warmup()
        streams = [runner.decode_stream() for _ in xs]
        got: dict[int, np.ndarray] = {}
        scopes = [anyio.CancelScope() for _ in xs]

        async def call(i: int) -> None:
            with scopes[i]:
                got[i] = await runner.moe(0, xs[i], stream=streams[i])

        with contextlib.ExitStack() as forwards:
            for stream in streams:  # three sequences in a forward pass, on their way to layer 0
                forwards.enter_context(stream.forward())
            async with anyio.create_task_group() as tg:
                for i in range(len(xs)):
                    tg.start_soon(call, i)
                    await anyio.sleep(0.01)  # 0 arrives first: it leads
                await _until(lambda: made[0].pending)  # the batch started: reads in flight
                scopes[victim].cancel()
                await anyio.sleep(0.05)
                assert victim not in got
                made[0].complete_all()
        assert sorted(got) == [i for i in range(3) if i != victim]
        for i, y in got.items():
            assert y.tobytes() == want[i].tobytes()
        st = runner.statistics()
        assert st.batches == 1 and st.batched_calls == 3  # one step served all three
        assert store._source.cache.pinned_slots == 0  # type: ignore[attr-defined]  # nothing stays pinned
        # the runner still serves (the batch read the victim's experts too: no read now)
        with streams[victim].forward():
            assert (await runner.moe(0, xs[victim], stream=streams[victim])).tobytes() == want[victim].tobytes()


async def test_a_caller_cancelled_before_the_batch_starts_is_dropped(small_model: Path, anyio_backend: object) -> None:
    xs = _inputs(3, SMALL.n_embd)
    want = await _reference(small_model, 0, xs)
    async with aioexperts.open(small_model, slots=64, io=THREADS) as store:
        runner = aioexperts.MoERunner(store, batch_wait=0.5, prefetch=aioexperts.PrefetchOptions(depth=0))
        await runner.warmup()
        streams = [runner.decode_stream() for _ in range(4)]
        got: dict[int, np.ndarray] = {}
        scopes = [anyio.CancelScope() for _ in xs]

        async def call(i: int) -> None:
            with scopes[i], streams[i].forward():
                got[i] = await runner.moe(0, xs[i], stream=streams[i])

        with streams[3].forward():  # a fourth stream on its way to layer 0 that never arrives: the window runs out
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(call, i)
                await anyio.sleep(0.1)
                assert not got  # waiting for the fourth
                scopes[0].cancel()  # the leader leaves: the next member leads
        assert sorted(got) == [1, 2]
        for i, y in got.items():
            assert y.tobytes() == want[i].tobytes()
        st = runner.statistics()
        assert st.batches == 1 and st.batched_calls == 2


async def test_one_callers_bad_input_does_not_fail_the_others(small_model: Path, anyio_backend: object) -> None:
    xs = _inputs(2, SMALL.n_embd)
    want = await _reference(small_model, 0, xs)
    big = np.full((1, SMALL.n_embd), 3e38, dtype=np.float32)  # finite, but the experts overflow float32
    async with aioexperts.open(small_model, slots=64, io=THREADS) as store:
        runner = aioexperts.MoERunner(store, batch_wait=1.0, prefetch=aioexperts.PrefetchOptions(depth=0))
        streams = [runner.decode_stream() for _ in range(3)]
        got: dict[int, object] = {}

        async def call(i: int, x: np.ndarray) -> None:
            with streams[i].forward():
                try:
                    got[i] = await runner.moe(0, x, stream=streams[i])
                except aioexperts.InvalidRequestError as exc:
                    got[i] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, 0, xs[0])
            tg.start_soon(call, 1, big)
            tg.start_soon(call, 2, xs[1])
        assert isinstance(got[1], aioexperts.InvalidRequestError)
        for i, j in ((0, 0), (2, 1)):
            y = got[i]
            assert isinstance(y, np.ndarray) and y.tobytes() == want[j].tobytes()


# -- hits-first -------------------------------------------------------------------------------------


async def _layer_with_half_resident(
    path: Path, x: np.ndarray, hits_first: bool, computed: list[int]
) -> tuple[aioexperts.MoEResult, set[int], set[int], int]:
    """Layer 0 on ``x`` with every other expert resident and the rest read only when the test says:
    the result, the experts computed before the reads were delivered, the resident ones, hits-first steps."""
    made: list[FakeBackend] = []
    io = aioexperts.IOOptions(backend=_fake(made))
    async with aioexperts.open(path, slots=64, io=io) as store:
        runner = aioexperts.MoERunner(
            store, hits_first=hits_first, batch_wait=0, prefetch=aioexperts.PrefetchOptions(depth=0)
        )
        await runner.warmup()
        resident = set(range(0, SMALL.n_expert, 2))

        async def warm() -> None:
            async with store.experts(0, sorted(resident)):
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(warm)
            await _until(lambda: made[0].pending)
            made[0].complete_all()
        assert all(store.resident(0, sorted(resident)))
        computed.clear()
        out: list[aioexperts.MoEResult] = []

        async def run() -> None:
            out.append(await runner.moe_result(0, x))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await _until(lambda: made[0].pending)  # the misses are being read
            await anyio.sleep(0.2)
            during = set(computed)  # computed while no miss was delivered
            made[0].complete_all()
        return out[0], during, resident, runner.statistics().hits_first_steps


async def test_hits_first_is_bit_equal_to_hits_last_and_computes_while_reads_wait(
    small_model: Path, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = np.random.default_rng(11).standard_normal((6, SMALL.n_embd)).astype(np.float32)  # most experts chosen
    computed: list[int] = []
    plain = moe_module._expert_forward

    def spy(x, rows, expert, *args, **kwargs):  # type: ignore[no-untyped-def]
        computed.append(expert)
        return plain(x, rows, expert, *args, **kwargs)

    monkeypatch.setattr(moe_module, "_expert_forward", spy)
    last, during_last, resident, steps_last = await _layer_with_half_resident(small_model, x, False, computed)
    first, during_first, _, steps_first = await _layer_with_half_resident(small_model, x, True, computed)
    chosen = set(np.unique(first.ids).tolist())
    assert chosen & resident and chosen - resident  # the case has both hits and misses
    assert during_first == chosen & resident and steps_first == 1  # the resident ones first, nothing read yet
    assert during_last == set() and steps_last == 0
    assert np.array_equal(first.ids, last.ids)
    assert first.ffn_out.tobytes() == last.ffn_out.tobytes()


# -- scheduling: who is waited for, how long, and arrival order ---------------------------------------


async def test_a_stream_two_steps_behind_is_not_waited_for(small_model: Path, anyio_backend: object) -> None:
    x = _inputs(1, SMALL.n_embd)[0]
    async with aioexperts.open(small_model, slots=64, io=THREADS) as store:
        layers = list(store.layout.layers)
        assert len(layers) >= 3
        want = await aioexperts.MoERunner(store, batch_wait=0, hits_first=False).moe(layers[2], x)
        runner = aioexperts.MoERunner(store, batch_wait=5.0, prefetch=aioexperts.PrefetchOptions(depth=0))
        await runner.warmup()
        ahead, behind = runner.decode_stream(), runner.decode_stream()
        with behind.forward(), ahead.forward():  # behind: still before its first MoE layer
            with anyio.fail_after(2):  # the old rule waited the whole 5 s window for it
                got = await runner.moe(layers[2], x, stream=ahead)
        assert got.tobytes() == want.tobytes()
        st = runner.statistics()
        assert st.batches == 0 and st.batch_window_seconds < 0.5


async def test_the_wait_is_bounded_by_what_the_layer_costs(anyio_backend: object) -> None:
    step = 0.05

    async def run(layer: int, requests: list[int]) -> list[object]:
        await anyio.sleep(step)
        return [r * 10 for r in requests]

    batcher: LayerBatcher[int, int] = LayerBatcher(5.0, run)
    batcher.set_layers([0, 1])
    assert batcher.bound(0) == 5.0  # no step measured yet: the window
    assert await batcher.submit(0, 1, None) == 10  # a lone call: no wait, and the layer's cost measured
    assert step <= batcher.bound(0) < 1.0 and batcher.bound(1) == 5.0
    a, never = batcher.stream(), batcher.stream()
    with never.forward(), a.forward():  # never: on its way to layer 0, but it does not come
        t0 = time.monotonic()
        with anyio.fail_after(2):
            assert await batcher.submit(0, 2, a) == 20
        took = time.monotonic() - t0
    assert took < 1.0  # the bound (about one step), not the 5 s window
    assert batcher.counters.window_seconds < 1.0


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
async def test_batched_results_are_bit_equal_to_alone_in_any_arrival_order(
    small_model: Path, order: tuple[int, ...], anyio_backend: object
) -> None:
    xs = [np.random.default_rng(20 + i).standard_normal((1, SMALL.n_embd)).astype(np.float32) for i in range(3)]
    want = await _reference(small_model, 0, xs)
    async with aioexperts.open(small_model, slots=64, io=THREADS) as store:
        runner = aioexperts.MoERunner(store, batch_wait=5.0, prefetch=aioexperts.PrefetchOptions(depth=0))
        await runner.warmup()
        async with store.experts(0, list(range(0, SMALL.n_expert, 2))):  # half resident: hits and misses
            pass
        streams = [runner.decode_stream() for _ in xs]
        got: dict[int, np.ndarray] = {}

        async def call(i: int) -> None:
            got[i] = await runner.moe(0, xs[i], stream=streams[i])

        with contextlib.ExitStack() as forwards:
            for s in streams:
                forwards.enter_context(s.forward())
            async with anyio.create_task_group() as tg:
                for i in order:
                    tg.start_soon(call, i)
                    await anyio.sleep(0.02)
        st = runner.statistics()
        assert st.batches == 1 and st.batched_calls == 3
        for i in range(3):
            assert got[i].tobytes() == want[i].tobytes(), f"call {i}, arrival order {order}"


def test_hits_first_pays_only_with_enough_misses_and_hits() -> None:
    assert not hits_first_pays(7, 1, 2)  # one miss: computed alone after the hits, one worker idle
    assert hits_first_pays(4, 4, 2) and hits_first_pays(6, 2, 2)
    assert not hits_first_pays(1, 7, 2)  # too few hits to fill the pool during the read
    assert not hits_first_pays(8, 3, 4) and hits_first_pays(8, 4, 4)
    assert not hits_first_pays(0, 0, 1)


@pytest.mark.parametrize("n_misses", [1, 3])
async def test_hits_first_splits_only_when_it_pays(small_model: Path, n_misses: int, anyio_backend: object) -> None:
    x = np.random.default_rng(11).standard_normal((2, SMALL.n_embd)).astype(np.float32)
    async with aioexperts.open(small_model, slots=64, io=THREADS) as store:
        runner = aioexperts.MoERunner(store, batch_wait=0, hits_first=False)
        want = await runner.moe_result(0, x)
    chosen = np.unique(want.ids).tolist()
    assert len(chosen) >= n_misses + 2
    async with aioexperts.open(small_model, slots=64, io=THREADS) as store:
        prefetch = aioexperts.PrefetchOptions(depth=0)
        runner = aioexperts.MoERunner(store, hits_first=True, batch_wait=0, prefetch=prefetch)
        await runner.warmup()
        async with store.experts(0, chosen[n_misses:]):  # all but n_misses of them resident
            pass
        got = await runner.moe(0, x)
        assert got.tobytes() == want.ffn_out.tobytes()
        split = hits_first_pays(len(chosen) - n_misses, n_misses, compute_pool().n_threads)
        assert runner.statistics().hits_first_steps == int(split)
        if n_misses == 1:
            assert not split  # one miss never splits


async def test_a_prompt_never_joins_the_decode_steps(
    small_model: Path, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows: list[int] = []
    plain = StepBatcher.submit

    async def spy(self, key, request):  # type: ignore[no-untyped-def]
        rows.append(request.start)
        return await plain(self, key, request)

    monkeypatch.setattr(StepBatcher, "submit", spy)
    alone = await _alone(small_model, PROMPTS, 3, slots=64, io=THREADS)
    together, st = await _together(small_model, PROMPTS, 3, slots=64, io=THREADS)
    _assert_bit_equal(alone, together)
    # only the decode steps asked for a batch (3 per sequence, each after its whole prompt): the
    # 2..5-token prompts ran alone, so no decode row waited for them
    assert sorted(rows) == sorted(len(p) + step for p in PROMPTS for step in range(3))
    assert st.batches > 0


async def test_the_first_layer_waits_for_a_stream_in_its_output_head(anyio_backend: object) -> None:
    steps: list[list[int]] = []

    async def run(layer: int, requests: list[int]) -> list[object]:
        steps.append(list(requests))
        return list(requests)

    batcher: LayerBatcher[int, int] = LayerBatcher(5.0, run)
    batcher.set_layers([0, 1])
    a, b = batcher.stream(), batcher.stream()
    got: list[int] = []

    async def first_of_next_token() -> None:
        with a.forward():
            got.append(await batcher.submit(0, 1, a))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with b.forward():
                await batcher.submit(1, 9, b)  # b's last MoE layer: now in its output head
                tg.start_soon(first_of_next_token)
                await anyio.sleep(0.1)
                assert not got  # a waits for b, about to come round
            with b.forward():
                got.append(await batcher.submit(0, 2, b))
    assert sorted(got) == [1, 2] and steps[-1] == [1, 2]


async def test_a_full_batch_starts_at_once_and_the_next_call_opens_another(anyio_backend: object) -> None:
    steps: list[list[int]] = []

    async def run(layer: int, requests: list[int]) -> list[object]:
        steps.append(sorted(requests))
        await anyio.sleep(0.05)
        return [r * 10 for r in requests]

    batcher: LayerBatcher[int, int] = LayerBatcher(5.0, run, max_calls=2)
    batcher.set_layers([0, 1])
    streams = [batcher.stream() for _ in range(5)]
    got: dict[int, int] = {}

    async def call(i: int) -> None:
        with streams[i].forward():
            got[i] = await batcher.submit(0, i, streams[i])

    t0 = time.monotonic()
    with anyio.fail_after(4):
        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(call, i)
    # five streams expected at layer 0: without the cap one batch would wait for all five; with it,
    # batches of at most two start as they fill, and the fifth call waits (bounded) for a partner
    assert got == {i: 10 * i for i in range(5)}
    assert sorted(map(len, steps)) == [1, 2, 2] and sorted(sum(steps, [])) == list(range(5))
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(ConfigError, match="max_calls"):
        LayerBatcher(1.0, run, max_calls=0)


def test_a_batched_step_prefetches_what_its_calls_share_at_one_calls_budget() -> None:
    a, b, c = [(1, 5), (1, 6), (2, 7)], [(1, 6), (1, 8), (2, 7)], [(1, 9), (2, 7), (1, 6)]
    assert batch_prefetch([a]) == a
    assert batch_prefetch([a, b, c]) == [(1, 6), (2, 7), (1, 5)]  # shared by 3, by 3, then in order
    assert len(batch_prefetch([a, b, c, [(3, e) for e in range(10)]])) == 10


async def test_a_layers_misses_are_submitted_before_its_hits_compute_and_before_the_prefetch(
    small_model: Path, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The misses go to the device the moment the layer step starts, in one submission with the
    prefetch of the layers ahead behind them, before the resident experts' compute job is handed
    to the compute pool (whose threads would otherwise hold the cores the event loop needs)."""
    from aioexperts import _executor as runner_module

    made: list[FakeBackend] = []
    io = aioexperts.IOOptions(backend=_fake(made))
    x = np.random.default_rng(11).standard_normal((6, SMALL.n_embd)).astype(np.float32)
    async with aioexperts.open(small_model, slots=64, io=io) as store:
        runner = aioexperts.MoERunner(store, batch_wait=0, prefetch=aioexperts.PrefetchOptions(depth=1))
        await runner.warmup()
        resident = list(range(0, SMALL.n_expert, 2))

        async def warm() -> None:
            async with store.experts(0, resident):
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(warm)
            await _until(lambda: made[0].pending)
            made[0].complete_all()
        fake = made[0]
        n_batches = len(fake.batches)
        at_handoff: list[list[tuple[int, int]]] = []
        plain = runner_module.run_in_worker

        async def spy(fn, *args):  # type: ignore[no-untyped-def]
            if fn is runner_module._timed_outputs and args[-1]:  # the hits' job (with the shared expert)
                at_handoff.append([op.context[0].plan.key for op in fake.pending])
            return await plain(fn, *args)

        monkeypatch.setattr(runner_module, "run_in_worker", spy)
        out: list[aioexperts.MoEResult] = []

        async def run() -> None:
            out.append(await runner.moe_result(0, x))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await _until(lambda: at_handoff)
            while fake.pending:
                fake.complete_all()
                await anyio.sleep(0.01)
        chosen = sorted(set(np.unique(out[0].ids).tolist()) - {-1})
        misses = [e for e in chosen if e not in resident]
        assert misses and len(misses) < len(chosen)  # the case has both hits and misses
        (pending,) = at_handoff
        loads = list(dict.fromkeys(pending))
        assert sorted(loads[: len(misses)]) == [(0, e) for e in misses]  # every miss, first
        assert {key[0] for key in loads[len(misses) :]} <= {1}  # then only the prefetch of layer 1
        assert len(loads) > len(misses)  # which is under way too
        assert len(fake.batches) == n_batches + 1  # one submission
        assert runner.statistics().hits_first_steps == 1


async def test_the_first_moe_layer_is_prefetched_from_the_embeddings_before_any_attention(
    small_model: Path, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step starts reading the experts its first MoE layer will likely choose (the router's
    choice for the FFN norm of the token's embeddings) before the first attention job runs."""
    from aioexperts._compute.norms import rms_norm
    from aioexperts._model.forward import ForwardPass

    async with aioexperts.load(small_model, slots=64, io=THREADS, batch_wait=0) as model:
        store, runner = model.store, model.runner
        events: list[tuple[str, object]] = []
        plain_pre = ForwardPass._pre_block

        def pre_block(self, layer, *args, **kwargs):  # type: ignore[no-untyped-def]
            events.append(("attention", layer.index))
            return plain_pre(self, layer, *args, **kwargs)

        plain_prefetch = store.prefetch

        def prefetch(keys):  # type: ignore[no-untyped-def]
            keys = list(keys)
            events.append(("prefetch", keys))
            return plain_prefetch(keys)

        monkeypatch.setattr(ForwardPass, "_pre_block", pre_block)
        monkeypatch.setattr(store, "prefetch", prefetch)
        async with model.sequence() as seq:
            await seq.forward(PROMPTS[0])
            events.clear()
            await seq.forward([6])
        layers = list(store.layout.layers)
        first = layers[0]
        block = next(layer for layer in model.forward_pass.weights.layers if layer.index == first)
        x = rms_norm(await model.forward_pass.embed([6]), block.ffn_norm, model.hparams.norm_eps)
        want = runner.predictor.predict(layers[-1], first, x, SMALL.n_expert_used)
    assert want and events[0] == ("prefetch", [(first, e) for e in want])
    assert events[1] == ("attention", 0)
