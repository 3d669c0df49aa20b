"""The one batcher (aioexperts._batcher.Batcher): its mechanics tested once, on both of its policies.

The model's step batcher (one step at a time, waits for the sequences expected back) and the MoE-only
API's layer batcher (keyed by layer, waits for the decode streams on their way) are the same core:
who joins, who leads, cancellation before and during a batch, a failed batch run again call by call.
Their own rules (who is expected, how long a window lasts) are in test_steps.py and test_batching.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import anyio
import pytest

from aioexperts._batch import LayerBatcher
from aioexperts._batcher import Batcher
from aioexperts._model.steps import StepBatcher

pytestmark = pytest.mark.anyio

POLICIES = ["step", "layer"]
WAIT = 5.0  # the window: long, so that a test that waits it out fails its fail_after


class Recorder:
    """A ``run`` that records each batch's requests (and which ran to their end), takes ``seconds``
    and answers ``request * 10``, or ``ValueError`` for a request in ``fail``; with ``fail_batches``
    a batch of several requests raises as a whole."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.completed: list[list[int]] = []
        self.seconds = seconds
        self.fail: set[int] = set()
        self.fail_batches = False
        self.entered = anyio.Event()

    def clear(self) -> None:
        self.batches.clear()
        self.completed.clear()
        self.entered = anyio.Event()

    async def __call__(self, requests: list[int]) -> list[int | Exception]:
        self.batches.append(list(requests))
        self.entered.set()
        await anyio.sleep(self.seconds)
        self.completed.append(list(requests))
        if self.fail_batches and len(requests) > 1:
            raise RuntimeError("the batch failed as a whole")
        return [ValueError(f"bad {r}") if r in self.fail else r * 10 for r in requests]


class Face:
    """One policy on the core: how its callers become expected, how they call, how they go away.
    A caller ``k`` asks for ``k`` (and gets ``10 * k``)."""

    batcher: Batcher[object, int, int]

    async def expect(self, keys: Iterable[int]) -> None:
        """The batches wait for ``keys`` from now on."""
        raise NotImplementedError

    async def call(self, key: int) -> int:
        raise NotImplementedError

    def gone(self, key: int) -> None:
        """``key`` will not come back."""


class StepFace(Face):
    def __init__(self, run: Recorder) -> None:
        self.steps: StepBatcher[int, int] = StepBatcher(run, 16, wait=WAIT)
        self.batcher = self.steps  # type: ignore[assignment]

    async def expect(self, keys: Iterable[int]) -> None:
        async with anyio.create_task_group() as tg:  # one step of them all: each is expected back
            for k in keys:
                tg.start_soon(self.call, k)

    async def call(self, key: int) -> int:
        return await self.steps.submit(key, key)

    def gone(self, key: int) -> None:
        self.steps.forget(key)


class LayerFace(Face):
    def __init__(self, run: Recorder) -> None:
        async def run_layer(layer: int, requests: list[int]) -> list[int | Exception]:
            return await run(requests)

        self.layers: LayerBatcher[int, int] = LayerBatcher(WAIT, run_layer)
        self.layers.set_layers([0, 1])
        self.batcher = self.layers  # type: ignore[assignment]
        self.streams: dict[int, object] = {}
        self.forwards = contextlib.ExitStack()

    async def expect(self, keys: Iterable[int]) -> None:
        for k in keys:  # in a forward pass, before the first MoE layer: on its way to layer 0
            s = self.streams[k] = self.layers.stream()
            self.forwards.enter_context(s.forward())

    async def call(self, key: int) -> int:
        if key not in self.streams:
            await self.expect([key])
        return await self.layers.submit(0, key, self.streams[key])  # type: ignore[arg-type]


async def make(policy: str, seconds: float = 0.0) -> tuple[Face, Recorder]:
    run = Recorder(seconds)
    return (StepFace(run) if policy == "step" else LayerFace(run)), run


async def together(face: Face, keys: Iterable[int]) -> dict[int, int | Exception]:
    got: dict[int, int | Exception] = {}

    async def call(k: int) -> None:
        try:
            got[k] = await face.call(k)
        except Exception as exc:
            got[k] = exc

    async with anyio.create_task_group() as tg:
        for k in keys:
            tg.start_soon(call, k)
    return got


def test_both_batchers_are_the_one_core() -> None:
    for policy in (StepBatcher, LayerBatcher):
        assert issubclass(policy, Batcher)
        for mechanics in ("join", "look", "_lead", "_gather", "_run_members", "_leave", "_may_lead", "_wake_head"):
            assert getattr(policy, mechanics) is getattr(Batcher, mechanics), (policy, mechanics)


@pytest.mark.parametrize("policy", POLICIES)
async def test_one_calls_error_is_its_own_and_a_failed_batch_is_run_call_by_call(
    policy: str, anyio_backend: object
) -> None:
    face, run = await make(policy)
    await face.expect(range(3))
    run.clear()
    run.fail = {1}
    with anyio.fail_after(3):
        got = await together(face, range(3))
    assert got[0] == 0 and got[2] == 20 and isinstance(got[1], ValueError)
    assert [sorted(b) for b in run.batches] == [[0, 1, 2]]  # one batch, one error

    face, run = await make(policy)
    await face.expect(range(3))
    run.clear()
    run.fail_batches = True  # the whole batch raises: each call alone
    with anyio.fail_after(3):
        got = await together(face, range(3))
    assert got == {i: i * 10 for i in range(3)}
    assert sorted(run.batches[0]) == [0, 1, 2] and sorted(run.batches[1:]) == [[0], [1], [2]]
    assert face.batcher.counters.retried_calls == 3


@pytest.mark.parametrize("role", ["leader", "member"])  # the first call leads: the window runs in its task
@pytest.mark.parametrize("policy", POLICIES)
async def test_a_call_cancelled_before_its_batch_starts_leaves_it(
    policy: str, role: str, anyio_backend: object
) -> None:
    face, run = await make(policy)
    await face.expect(range(4))
    run.clear()
    victim = 0 if role == "leader" else 1
    scope = anyio.CancelScope()
    got: dict[int, int] = {}

    async def call(k: int) -> None:
        with scope if k == victim else contextlib.nullcontext():
            got[k] = await face.call(k)

    with anyio.fail_after(3):  # a leader that does not hand over leaves the others to the 5 s window
        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(call, k)
                await anyio.sleep(0.01)
            await anyio.sleep(0.1)
            assert not run.batches  # waiting for 3, expected
            scope.cancel()
            face.gone(victim)
            await anyio.sleep(0.05)
            assert not run.batches  # still waiting for 3: the window goes on without the victim
            tg.start_soon(call, 3)
    assert [sorted(b) for b in run.batches] == [sorted({0, 1, 2, 3} - {victim})]
    assert got == {k: k * 10 for k in range(4) if k != victim}
    assert face.batcher.counters.batches == 1 + (policy == "step")  # the step face's expect is a batch


@pytest.mark.parametrize("role", ["leader", "member"])  # the leader runs the batch in its task
@pytest.mark.parametrize("policy", POLICIES)
async def test_a_call_cancelled_during_its_batch_leaves_the_others_results(
    policy: str, role: str, anyio_backend: object
) -> None:
    face, run = await make(policy, seconds=0.3)
    await face.expect(range(3))
    run.clear()
    scopes = [anyio.CancelScope() for _ in range(3)]
    got: dict[int, int] = {}

    async def call(k: int) -> None:
        with scopes[k]:
            got[k] = await face.call(k)

    with anyio.fail_after(3):
        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(call, k)
            await run.entered.wait()
            victim = run.batches[0][0] if role == "leader" else run.batches[0][1]  # the first to ask leads
            scopes[victim].cancel()
    assert [sorted(b) for b in run.completed] == [[0, 1, 2]]  # its rows computed, to the batch's end
    assert got == {k: k * 10 for k in range(3) if k != victim}  # the victim's result dropped
    for k in range(3):
        face.gone(k)
    with anyio.fail_after(3):
        assert await face.call(5) == 50  # the batcher still serves
