"""Continuous batching of decode steps: one step at a time for every sequence that asks for one.

Each decoding sequence runs in its own task and asks for its next token's step with
:meth:`StepBatcher.submit`. One step runs at a time: the calls that arrive while it runs wait for it
to end and then go together in the next one (llama.cpp's server and vLLM batch the same way), so
the sequences stay in phase and every step shares its dense products and expert reads among them.

Before a step starts it waits, within the *window* (``wait`` seconds), for the sequences that ended
the previous step moments ago and are expected back (sampling, a network write); it never waits
for a sequence that is not expected (a lone sequence never waits, a sequence that stopped or
closed holds no one back) and takes at most ``max_calls`` calls (the rest go in the next step).
Calls woken at the same moment settle for a few scheduler turns first, so they start together.

The step runs in the task of its first call (the leader). A call cancelled before its step starts
leaves; one cancelled during the step has its result dropped (its rows are still computed: the
run keeps what it writes alive). A leader cancelled during a step of several calls finishes the
step first (one token's step). A step that fails as a whole is run again call by call.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

from aioexperts._batch import BatchCounters
from aioexperts._checks import check_int

__all__ = ("SETTLE_TURNS", "StepBatcher", "StepCounters")

R = TypeVar("R")
T = TypeVar("T")

SETTLE_TURNS = 4
"""Scheduler turns a step's leader yields before it looks who is there (calls woken together)."""

#: ``run(requests) -> outcomes``: one result (or the exception of that request) per request;
#: raising fails the step as a whole (each request is then run alone).
RunSteps = Callable[[list[R]], Awaitable[list["T | Exception"]]]


@dataclass(slots=True)
class StepCounters(BatchCounters):
    """Counters of a :class:`StepBatcher`: those of :class:`~aioexperts._batch.BatchCounters` (a
    batch being a step that served more than one call, its window the wait for expected calls), and:

    Attributes:
        steps: steps run.
    """

    steps: int = 0


@dataclass(eq=False, slots=True)
class _Call(Generic[R]):
    key: Hashable
    request: R
    wake: anyio.Event = field(default_factory=anyio.Event)
    outcome: object = None
    finished: bool = False
    taken: bool = False


class _Retry:
    """The step failed as a whole: run the call alone."""


_RETRY = _Retry()


class StepBatcher(Generic[R, T]):
    """One step at a time for all the calls waiting (module docstring).

    Args:
        run: runs the requests of one step (``RunSteps``).
        max_calls: calls one step takes at most.
        wait: the window in seconds.

    Raises:
        ConfigError: ``max_calls`` is not an int >= 1.
    """

    def __init__(self, run: RunSteps[R, T], max_calls: int, wait: float) -> None:
        self.max_calls = max_calls
        check_int(self, "max_calls", low=1)
        self.wait = wait
        self._run = run
        self._pending: list[_Call[R]] = []
        self._running = False
        self._recent: dict[Hashable, float] = {}  # key -> when its last step ended
        self._arrived = anyio.Event()
        self.counters = StepCounters()

    def forget(self, key: Hashable) -> None:
        """``key`` will not come back (its sequence closed or stopped): no step waits for it."""
        if self._recent.pop(key, None) is not None:
            self._arrived.set()

    def _expected(self, now: float) -> bool:
        """Whether a sequence that ended a step within the window is not back yet."""
        waiting = {c.key for c in self._pending}
        for key, ended in list(self._recent.items()):
            if now - ended >= self.wait:
                del self._recent[key]  # gone a while: forgotten until its next step
            elif key not in waiting:
                return True
        return False

    async def submit(self, key: Hashable, request: R) -> T:
        """Run ``request`` in the next step and return its result.

        Args:
            key: the calling sequence (one call per key at a time).
            request: what ``run`` takes.

        Raises:
            What running the request raises (alone, if its step failed as a whole).
        """
        me: _Call[R] = _Call(key, request)
        self._pending.append(me)
        self._arrived.set()
        try:
            while not me.finished:
                if not self._running and self._pending and self._pending[0] is me:
                    await self._lead()
                else:
                    me.wake = anyio.Event()
                    if me.finished:
                        break
                    await me.wake.wait()
        except BaseException:
            if not me.taken and me in self._pending:
                self._pending.remove(me)
                self._wake_next()
            raise
        outcome = me.outcome
        if outcome is _RETRY:
            self.counters.retried_calls += 1
            (outcome,) = await self._run([request])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome  # type: ignore[return-value]

    def _wake_next(self) -> None:
        if not self._running and self._pending:
            self._pending[0].wake.set()

    async def _lead(self) -> None:
        self._running = True
        members: list[_Call[R]] = []
        try:
            t0 = time.monotonic()
            for _ in range(SETTLE_TURNS):  # calls woken at the same moment arrive first
                await anyio.lowlevel.checkpoint()
            deadline = t0 + self.wait
            while len(self._pending) < self.max_calls:
                now = time.monotonic()
                if now >= deadline or not self._expected(now):
                    break
                self._arrived = anyio.Event()
                with anyio.move_on_after(deadline - now):
                    await self._arrived.wait()
            members = self._pending[: self.max_calls]
            del self._pending[: self.max_calls]
            for m in members:
                m.taken = True
            c = self.counters
            c.window_seconds += time.monotonic() - t0
            c.steps += 1
            if len(members) > 1:
                c.batches += 1
                c.batched_calls += len(members)
            # the others' step runs here: a cancelled leader finishes it first (one step), then the
            # cancellation is delivered at its next checkpoint
            with anyio.CancelScope(shield=len(members) > 1):
                outcomes: list[object]
                try:
                    outcomes = list(await self._run([m.request for m in members]))
                except Exception as exc:
                    outcomes = [exc] if len(members) == 1 else [_RETRY] * len(members)
            now = time.monotonic()
            for m, outcome in zip(members, outcomes, strict=True):
                m.outcome, m.finished = outcome, True
                self._recent[m.key] = now
        finally:
            self._running = False
            for m in members:
                if not m.finished:  # the leader raised before the outcomes: the others go alone
                    m.outcome, m.finished = _RETRY, True
                m.wake.set()
            self._wake_next()
        await anyio.lowlevel.checkpoint_if_cancelled()
