"""The one batcher: concurrent calls of one key taken together into one batch, run in one caller's task.

Both batchers of the package are this class with a policy on it: the model's decode steps
(:class:`aioexperts._model.steps.StepBatcher`: one key, one step at a time, waits for the sequences
expected back) and the MoE layer steps of the MoE-only API (:class:`aioexperts._batch.LayerBatcher`:
keyed by MoE layer, waits for the decode streams on their way to the layer, bound by the layer's
step cost). The mechanics are here, once:

- **Join.** A call of key ``k`` waits in ``k``'s queue, in arrival order. Its next batch takes the
  first ``max_calls`` calls (the rest go in the batch after).
- **Leader.** The first call of the queue leads the next batch: it runs the window and then the
  batch in its own task. With ``one_at_a_time`` a key's batches run one after the other (a call that
  arrives while one runs waits for it to end and goes in the next); without, the next batch of a
  key gathers while the previous one runs (batches pipeline).
- **Window.** Before it starts, a batch waits for the calls the policy expects (:meth:`Batcher._complete`),
  at most its window (:meth:`Batcher._window`, seconds from when its leader began to lead), and not
  at all once it holds ``max_calls`` calls. A lone caller never waits for nobody.
- **Cancellation.** A call cancelled before its batch starts leaves it (a leader hands over to the next
  call, which keeps the window's deadline). Once the batch has started its rows are still computed
  (``run`` keeps what it writes alive; the slots stay pinned until the kernels are done) but nobody
  takes the result. A leader cancelled during a batch of several calls finishes it first (one step),
  then takes the cancellation.
- **Failure.** ``run`` answers each request (a result or that request's exception); a ``run`` that
  raises fails the batch as a whole, and each of its calls is run again alone, so one call's bad
  input never fails another's.
- **Counters**: :class:`BatchCounters`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

from ._checks import check_int

__all__ = ("BatchCounters", "Batcher", "RunBatch")

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
T = TypeVar("T")

#: ``run(key, requests) -> outcomes``: one result (or the exception of that request) per request, in
#: order; raising fails the batch as a whole (each request is then run alone).
RunBatch = Callable[[K, list[R]], Awaitable[Sequence["T | Exception"]]]


@dataclass(slots=True)
class BatchCounters:
    """A batcher's counters (read by the runner's and the model's statistics).

    Attributes:
        steps: batches run (of one call or more).
        batches: batches that served more than one call.
        batched_calls: calls served by those batches.
        retried_calls: calls run alone again after their batch failed as a whole.
        window_seconds: time batches waited for their calls, summed.
    """

    steps: int = 0
    batches: int = 0
    batched_calls: int = 0
    retried_calls: int = 0
    window_seconds: float = 0.0


class _Retry:
    """The batch failed as a whole: run the call alone."""


_RETRY = _Retry()


@dataclass(eq=False, slots=True)
class _Call(Generic[R]):
    request: R
    caller: Hashable  # who asks (a stream, a sequence's key): what the policy expects
    wake: anyio.Event = field(default_factory=anyio.Event)
    outcome: object = None
    finished: bool = False
    taken: bool = False  # in a batch that started


@dataclass(eq=False, slots=True)
class _Queue(Generic[K, R]):
    """The calls of one key not in a batch yet, and the state of its next batch's window."""

    key: K
    calls: list[_Call[R]] = field(default_factory=list)
    leading: bool = False  # the first call is running the window
    running: int = 0  # batches of this key running
    window: float = 0.0  # seconds the next batch waits at most (set when its window opens)
    deadline: float | None = None  # None: the next batch's window has not opened
    look: anyio.Event = field(default_factory=anyio.Event)  # set: the leader looks again


class Batcher(Generic[K, R, T]):
    """Takes concurrent calls of one key together into one batch (module docstring).

    A policy subclasses it and overrides the window hooks (:meth:`_window`, :meth:`_complete`,
    :meth:`_look_again`) and the notes (:meth:`_starting`, :meth:`_ran`, :meth:`_waited`); the
    mechanics (:meth:`join`) are not overridden.

    Args:
        run: runs the requests of one batch of a key (``RunBatch``).
        wait: the window in seconds (what :meth:`_window` gives by default). Settable.
        max_calls: calls one batch takes at most (None: no cap).
        one_at_a_time: a key's next batch starts only when its previous one has ended.
        settle_turns: scheduler turns a leader yields before it looks who is there (calls woken at
            the same moment arrive first).

    Raises:
        ConfigError: ``max_calls`` is not None or an int >= 1.
    """

    def __init__(
        self,
        run: RunBatch[K, R, T],
        *,
        wait: float,
        max_calls: int | None = None,
        one_at_a_time: bool = False,
        settle_turns: int = 0,
    ) -> None:
        self.max_calls = max_calls
        check_int(self, "max_calls", low=1, optional=True)
        self.wait = wait
        self.one_at_a_time = one_at_a_time
        self.settle_turns = settle_turns
        self.counters = BatchCounters()
        self._run = run
        self._queues: dict[K, _Queue[K, R]] = {}

    # -- the policy's hooks ----------------------------------------------------------------------

    def _window(self, key: K) -> float:
        """Seconds the next batch of ``key`` waits at most, asked when its window opens."""
        return self.wait

    def _complete(self, key: K, callers: Collection[Hashable], window: float, now: float) -> bool:
        """Whether no caller but ``callers`` (those waiting) is expected for ``key``'s next batch:
        it starts now. ``window``: what :meth:`_window` gave for it."""
        return True

    def _look_again(self, key: K, window: float, now: float) -> float:
        """A time before the deadline at which :meth:`_complete` may change by itself (nobody calls
        :meth:`look`); infinity for none."""
        return math.inf

    def _starting(self, key: K, n: int) -> None:
        """A batch of ``n`` calls of ``key`` starts."""

    def _ran(self, key: K, callers: list[Hashable], seconds: float | None) -> None:
        """A batch of ``key`` ended: its callers, its wall time (None: it failed as a whole)."""

    def _waited(self, key: K, caller: Hashable) -> None:
        """``caller``'s call of ``key`` stopped waiting (its batch ended, or it was cancelled or failed)."""

    # -- calls ------------------------------------------------------------------------------------

    def look(self) -> None:
        """Who is expected changed: every batch in its window looks again."""
        for q in self._queues.values():
            q.look.set()

    async def join(self, key: K, request: R, caller: Hashable = None) -> T:
        """Run ``request`` in the next batch of ``key`` and return its result.

        Args:
            key: which batches the call may go in (a MoE layer; None for the model's one step queue).
            request: what ``run`` takes.
            caller: who asks (what the policy's :meth:`_complete` knows); one call per caller at a time.

        Raises:
            What running the request raises (alone, if its batch failed as a whole).
        """
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = _Queue(key)
        me: _Call[R] = _Call(request, caller)
        q.calls.append(me)
        q.look.set()
        try:
            while not me.finished:
                if q.calls and q.calls[0] is me and self._may_lead(q):
                    await self._lead(q)
                else:
                    me.wake = anyio.Event()
                    await me.wake.wait()
        except BaseException:
            self._leave(q, me)
            raise
        finally:
            self._waited(key, caller)
        outcome = me.outcome
        if outcome is _RETRY:
            self.counters.retried_calls += 1
            (outcome,) = await self._run(key, [request])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome  # type: ignore[return-value]

    def _may_lead(self, q: _Queue[K, R]) -> bool:
        return not q.leading and not (self.one_at_a_time and q.running)

    def _wake_head(self, q: _Queue[K, R]) -> None:
        """The first call of ``q`` leads now, if it may."""
        if q.calls and self._may_lead(q):
            q.calls[0].wake.set()

    def _release(self, q: _Queue[K, R]) -> None:
        if not q.calls and not q.leading and not q.running and self._queues.get(q.key) is q:
            del self._queues[q.key]

    def _leave(self, q: _Queue[K, R], me: _Call[R]) -> None:
        """A cancelled (or failed) call: out of its queue before its batch starts; else its result is dropped."""
        if me.taken or me not in q.calls:
            return
        q.calls.remove(me)
        if not q.calls:
            q.deadline = None  # the window closes with its last call
        self._wake_head(q)  # a leader hands over (the window keeps its deadline)
        self._release(q)

    # -- a batch -----------------------------------------------------------------------------------

    async def _lead(self, q: _Queue[K, R]) -> None:
        q.leading = True
        try:
            members = await self._gather(q)
        finally:
            q.leading = False
        q.running += 1
        self._wake_head(q)  # the next batch gathers while this one runs (unless one at a time)
        try:
            await self._run_members(q.key, members)
        finally:
            q.running -= 1
            for m in members:
                if not m.finished:  # the leader raised before the outcomes: the others go alone
                    m.outcome, m.finished = _RETRY, True
                m.wake.set()
            self._wake_head(q)
            self._release(q)
        await anyio.lowlevel.checkpoint_if_cancelled()  # a leader cancelled during the batch: its rows are dropped

    async def _gather(self, q: _Queue[K, R]) -> list[_Call[R]]:
        """The window of ``q``'s next batch, then its calls (taken out of the queue)."""
        t0 = time.monotonic()
        for _ in range(self.settle_turns):  # calls woken at the same moment arrive first
            await anyio.lowlevel.checkpoint()
        if q.deadline is None:
            q.window = self._window(q.key)
            q.deadline = t0 + q.window
        cap = self.max_calls
        while cap is None or len(q.calls) < cap:
            now = time.monotonic()
            if now >= q.deadline or self._complete(q.key, {c.caller for c in q.calls}, q.window, now):
                break
            until = min(q.deadline, self._look_again(q.key, q.window, now))
            q.look = anyio.Event()
            with anyio.move_on_after(until - now):
                await q.look.wait()
        members = q.calls[:cap]
        del q.calls[:cap]
        q.deadline = None
        for m in members:
            m.taken = True
        c = self.counters
        c.window_seconds += time.monotonic() - t0
        c.steps += 1
        if len(members) > 1:
            c.batches += 1
            c.batched_calls += len(members)
        return members

    async def _run_members(self, key: K, members: list[_Call[R]]) -> None:
        self._starting(key, len(members))
        # the others' batch runs here: a cancelled leader finishes it first (one step), then the
        # cancellation is delivered at its next checkpoint
        with anyio.CancelScope(shield=len(members) > 1):
            outcomes: list[object]
            took: float | None = None
            t1 = time.monotonic()
            try:
                outcomes = list(await self._run(key, [m.request for m in members]))
            except Exception as exc:
                outcomes = [exc] if len(members) == 1 else [_RETRY] * len(members)
            else:
                took = time.monotonic() - t1
            self._ran(key, [m.caller for m in members], took)
        for m, outcome in zip(members, outcomes, strict=True):
            m.outcome, m.finished = outcome, True
