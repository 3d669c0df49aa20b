"""The step batcher (continuous batching of decode steps): who goes in which step, waits, cancellation, failures."""

from __future__ import annotations

import time

import anyio
import pytest

from aioexperts._errors import ConfigError
from aioexperts._model.steps import StepBatcher

pytestmark = pytest.mark.anyio


class Recorder:
    """A ``run`` that records each step's requests, takes ``seconds`` and answers ``request * 10``."""

    def __init__(self, seconds: float = 0.0, fail: set[int] | None = None, fail_steps: bool = False) -> None:
        self.steps: list[list[int]] = []
        self.seconds = seconds
        self.fail = fail or set()
        self.fail_steps = fail_steps
        self.entered = anyio.Event()

    async def __call__(self, requests: list[int]) -> list[int | Exception]:
        self.steps.append(list(requests))
        self.entered.set()
        await anyio.sleep(self.seconds)
        if self.fail_steps and len(requests) > 1:
            raise RuntimeError("the step failed as a whole")
        return [ValueError(f"bad {r}") if r in self.fail else r * 10 for r in requests]


async def test_a_lone_call_never_waits(anyio_backend: object) -> None:
    run = Recorder()
    steps = StepBatcher(run, 16, wait=5.0)
    with anyio.fail_after(1):
        for i in range(3):  # the same key again and again: it is the one expected, and it is here
            assert await steps.submit("a", i) == i * 10
    assert run.steps == [[0], [1], [2]]
    assert steps.counters.batches == 0 and steps.counters.steps == 3


async def test_calls_that_arrive_together_go_in_one_step(anyio_backend: object) -> None:
    run = Recorder()
    steps = StepBatcher(run, 16, wait=5.0)
    got: dict[int, int] = {}

    async def call(i: int) -> None:
        got[i] = await steps.submit(i, i)

    with anyio.fail_after(1):  # nobody expected: no window
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(call, i)
    assert [sorted(step) for step in run.steps] == [[0, 1, 2, 3]]  # in the order they arrived
    assert got == {i: i * 10 for i in range(4)}
    assert steps.counters.batches == 1 and steps.counters.batched_calls == 4


async def test_a_call_arriving_during_a_step_joins_the_next_one_with_the_returning_calls(
    anyio_backend: object,
) -> None:
    run = Recorder(seconds=0.2)
    steps = StepBatcher(run, 16, wait=1.0)

    async def sequence(key: str, first: int, late: float = 0.0) -> None:
        await anyio.sleep(late)
        for token in range(first, first + 2):
            await steps.submit(key, token)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sequence, "a", 0)
            tg.start_soon(sequence, "b", 10)
            tg.start_soon(sequence, "c", 20, 0.05)  # while a and b's first step runs
    # one step at a time: c waits for it, then goes first with a and b's next tokens; the last one alone
    assert [sorted(step) for step in run.steps] == [[0, 10], [1, 11, 20], [21]]
    assert run.steps[1][0] == 20


async def test_a_step_takes_max_calls_at_most(anyio_backend: object) -> None:
    run = Recorder(seconds=0.01)
    steps = StepBatcher(run, 2, wait=1.0)
    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(steps.submit, i, i)
    assert [len(s) for s in run.steps] == [2, 2, 1]
    assert sorted(r for s in run.steps for r in s) == list(range(5))
    with pytest.raises(ConfigError):
        StepBatcher(run, 0, wait=1.0)


async def test_the_window_waits_for_an_expected_sequence_only_until_it_is_forgotten(anyio_backend: object) -> None:
    run = Recorder()
    steps = StepBatcher(run, 16, wait=5.0)
    await steps.submit("gone", 0)  # "gone" ended a step just now: expected back within the window
    started = time.monotonic()

    async def forget_soon() -> None:
        await anyio.sleep(0.2)
        steps.forget("gone")  # its sequence closed

    with anyio.fail_after(3):
        async with anyio.create_task_group() as tg:
            tg.start_soon(forget_soon)
            assert await steps.submit("other", 1) == 10
    waited = time.monotonic() - started
    assert 0.15 < waited < 2.0  # held for "gone" until it was forgotten, not the 5 s window
    assert run.steps == [[0], [1]]


async def test_an_expected_sequence_is_waited_for_at_most_the_window(anyio_backend: object) -> None:
    run = Recorder()
    steps = StepBatcher(run, 16, wait=0.2)
    await steps.submit("slow", 0)
    started = time.monotonic()
    assert await steps.submit("other", 1) == 10
    assert 0.1 < time.monotonic() - started < 1.0
    started = time.monotonic()
    assert await steps.submit("other", 2) == 20  # "slow" ended more than the window ago: forgotten
    assert time.monotonic() - started < 0.1
    assert steps.counters.window_seconds >= 0.1


async def test_a_call_cancelled_before_its_step_is_not_run(anyio_backend: object) -> None:
    run = Recorder(seconds=0.2)
    steps = StepBatcher(run, 16, wait=1.0)
    got: dict[int, int] = {}
    scope = anyio.CancelScope()

    async def call(i: int, delay: float) -> None:
        await anyio.sleep(delay)
        got[i] = await steps.submit(i, i)

    async def victim() -> None:
        with scope:
            await anyio.sleep(0.05)
            await steps.submit(9, 9)  # waits for the running step

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 0, 0.0)
        tg.start_soon(victim)
        tg.start_soon(call, 1, 0.06)
        await anyio.sleep(0.1)
        scope.cancel()
    assert got == {0: 0, 1: 10}
    assert run.steps == [[0], [1]]  # 9 never ran; 1 led the next step


@pytest.mark.parametrize("role", ["leader", "member"])  # the leader runs the step in its task
async def test_a_call_cancelled_during_its_step_leaves_the_others_results(role: str, anyio_backend: object) -> None:
    run = Recorder(seconds=0.3)
    steps = StepBatcher(run, 16, wait=1.0)
    got: dict[int, int] = {}
    scopes = [anyio.CancelScope() for _ in range(3)]
    victim = -1

    async def call(i: int) -> None:
        with scopes[i]:
            got[i] = await steps.submit(i, i)

    with anyio.fail_after(3):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(call, i)
            await run.entered.wait()
            victim = run.steps[0][0] if role == "leader" else run.steps[0][1]  # the first to ask leads
            scopes[victim].cancel()
    assert [sorted(step) for step in run.steps] == [[0, 1, 2]]  # the step ran to its end for the others
    assert got == {i: i * 10 for i in range(3) if i != victim}
    assert await steps.submit("after", 5) == 50  # the batcher still serves


async def test_one_calls_error_is_its_own_and_a_failed_step_is_run_call_by_call(anyio_backend: object) -> None:
    run = Recorder(fail={1})
    steps = StepBatcher(run, 16, wait=1.0)
    got: dict[int, object] = {}

    async def call(i: int) -> None:
        try:
            got[i] = await steps.submit(i, i)
        except ValueError as exc:
            got[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(call, i)
    assert got[0] == 0 and got[2] == 20 and isinstance(got[1], ValueError)

    run = Recorder(fail_steps=True)  # the whole step raises: each call alone
    steps = StepBatcher(run, 16, wait=1.0)
    got.clear()
    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(call, i)
    assert got == {i: i * 10 for i in range(3)}
    assert sorted(run.steps[0]) == [0, 1, 2] and sorted(run.steps[1:]) == [[0], [1], [2]]
    assert steps.counters.retried_calls == 3
