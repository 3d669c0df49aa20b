"""Cross-request expert batching: the MoE steps of sequences decoding at the same moment, taken together.

Each decoding sequence is a :class:`DecodeStream` of the runner; while its forward pass runs, the
batcher knows which MoE layer it goes to next. A call for layer ``L`` opens a batch there (or joins
the open one); the batch starts when it holds ``max_calls`` calls (the next call opens another batch, so that
batches pipeline) or as soon as no other stream is on its way to ``L`` (within one MoE step
of it: a stream whose last MoE step was ``L - 1`` or ``L - 2`` of this token, or, when ``L`` is the first
MoE layer, one past its last MoE layer or that ended a token moments ago), and at the latest after
its *bound*: the smaller of ``wait`` and what a step of ``L`` costs (the moving average of its last
steps' wall time, see :meth:`LayerBatcher.bound`). Past that bound a straggler is better off running its own step than
holding the others back. A lone caller never waits; a stream two or more MoE steps behind is never
waited for; streams in step stay in step (they leave a step together and arrive at the next layer
within one attention job of each other); one that is ahead waits for those behind, once, at most
one step's cost.

The batch runs in the task of the call that opened it (its leader). A call cancelled before the start
leaves the batch (a leader hands over to the next member); once the batch has started its rows are
still computed (the slots stay pinned until the kernels are done) but nobody takes the result. A
batch that fails as a whole (a read error, a slab too small for the union) is retried call by call,
so one call's bad expert never fails another call's step.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

from ._checks import check_int
from ._errors import ConfigError

__all__ = ("DEFAULT_BATCH_WAIT", "BatchCounters", "DecodeStream", "LayerBatcher", "check_batch_wait")

DEFAULT_BATCH_WAIT = 0.05
"""Seconds a batch of decode steps stays open for the other streams at most (the window); the
wait of a layer is also bounded by what its step costs (:meth:`LayerBatcher.bound`)."""

COST_SMOOTHING = 0.5
"""Weight of the newest step in a layer's moving average of step wall time (the wait bound)."""

TRACE_MAX_EVENTS = 1 << 16
"""Events a timeline (:meth:`LayerBatcher.record_timeline`) keeps at most (the first ones)."""

R = TypeVar("R")
T = TypeVar("T")

#: ``run(layer, requests) -> outcomes``: one result (or the exception of that request) per request;
#: raising fails the batch as a whole.
RunBatch = Callable[[int, list[R]], Awaitable[list["T | Exception"]]]


def check_batch_wait(value: object) -> float:
    """``batch_wait`` as seconds (0 for off), or ConfigError.

    Raises:
        ConfigError: not None, and not a number in 0..10 seconds.
    """
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 10:
        raise ConfigError(f"batch_wait must be seconds in 0..10 (0 or None: no batching), got {value!r}")
    return float(value)


class DecodeStream:
    """One decoding sequence of a runner (:meth:`aioexperts.MoERunner.decode_stream`).

    Pass it to :meth:`~aioexperts.MoERunner.moe` from inside :meth:`forward` so that the runner batches
    this sequence's MoE steps with those of the other streams decoding at the same moment.
    """

    __slots__ = ("_batcher", "_ended", "_in_forward", "_number", "_position")

    def __init__(self, batcher: LayerBatcher[object, object], number: int = 0) -> None:
        self._batcher = batcher
        self._number = number  # for the timeline
        self._position = 0  # index (in MoE layer order) of the next layer this token goes to
        self._in_forward = False
        self._ended = 0.0

    def forward(self) -> _Forward:
        """Context manager around one decode forward pass of this sequence (not reentrant)."""
        return _Forward(self)

    def __repr__(self) -> str:
        return f"<DecodeStream at layer #{self._position}{' (in a forward pass)' if self._in_forward else ''}>"


class _Forward:
    __slots__ = ("_stream",)

    def __init__(self, stream: DecodeStream) -> None:
        self._stream = stream

    def __enter__(self) -> DecodeStream:
        s = self._stream
        s._position, s._in_forward = 0, True
        s._batcher._streams[s] = None
        s._batcher._recheck()
        return s

    def __exit__(self, *exc_info: object) -> None:
        s = self._stream
        s._position, s._in_forward, s._ended = 0, False, time.monotonic()
        s._batcher._recheck()


@dataclass(slots=True)
class BatchCounters:
    """The batcher's counters (read by the runner's statistics).

    Attributes:
        batches: layer steps that served more than one call.
        batched_calls: calls served by those steps.
        retried_calls: calls run alone again after their batch failed as a whole.
        window_seconds: time batches waited for their members, summed.
    """

    batches: int = 0
    batched_calls: int = 0
    retried_calls: int = 0
    window_seconds: float = 0.0


class _Retry:
    """The batch failed as a whole: run the call alone."""


_RETRY = _Retry()


@dataclass(eq=False, slots=True)
class _Member(Generic[R]):
    request: R
    stream: DecodeStream | None
    wake: anyio.Event = field(default_factory=anyio.Event)
    outcome: object = None
    finished: bool = False
    cancelled: bool = False


@dataclass(eq=False, slots=True)
class _Batch(Generic[R]):
    layer: int
    index: int
    deadline: float
    bound: float
    members: list[_Member[R]] = field(default_factory=list)
    leader: _Member[R] | None = None
    full: anyio.Event = field(default_factory=anyio.Event)
    started: bool = False


class LayerBatcher(Generic[R, T]):
    """Gathers concurrent calls of one layer into one step (module docstring).

    Args:
        wait: the window in seconds (0: the runner does not batch).
        run: runs a list of requests of one layer (see ``RunBatch``).
        max_calls: calls a batch takes at most (None: no cap); a full batch starts at once and
            the layer's next call opens a new one.

    Raises:
        ConfigError: ``max_calls`` is not None or an int >= 1.
    """

    def __init__(self, wait: float, run: RunBatch[R, T], max_calls: int | None = None) -> None:
        self.wait = wait
        self.max_calls = max_calls
        check_int(self, "max_calls", low=1, optional=True)
        self._index: dict[int, int] = {}
        self._run = run
        self._open: dict[int, _Batch[R]] = {}
        self._streams: dict[DecodeStream, None] = {}
        self._made = 0
        self._cost: dict[int, float] = {}  # layer index -> moving average of a step's wall seconds
        self.counters = BatchCounters()
        self._events: list[tuple[float, str, int, int]] | None = None

    def record_timeline(self, on: bool = True) -> None:
        """Start (or stop) recording a timeline of the layer steps (see :meth:`timeline`); starting
        clears the one recorded so far."""
        self._events = [] if on else None

    def timeline(self) -> list[tuple[float, str, int, int]]:
        """The recorded events ``(monotonic seconds, event, layer, n)``, oldest first.

        Events: ``arrive`` (a call reached the layer; ``n``: its stream's number, -1 without one),
        ``start`` (a batch started; ``n``: its calls), ``read`` (its experts are pinned, the misses
        read; ``n``: calls), ``computed`` (its expert rows are computed; ``n``: calls) and ``done``
        (its outcomes are handed out; ``n``: calls). At most :data:`TRACE_MAX_EVENTS` are kept.
        """
        return list(self._events or ())

    def note(self, event: str, layer: int, n: int) -> None:
        """Add an event to the timeline being recorded (nothing when none is)."""
        if self._events is not None and len(self._events) < TRACE_MAX_EVENTS:
            self._events.append((time.monotonic(), event, layer, n))

    def set_layers(self, layers: Sequence[int]) -> None:
        """The MoE layers in the order a token goes through them (before the first :meth:`submit`)."""
        self._index = {layer: i for i, layer in enumerate(layers)}

    def stream(self) -> DecodeStream:
        """A new stream (no resources: it counts only inside its ``forward()`` and just after)."""
        self._made += 1
        return DecodeStream(self, self._made)  # type: ignore[arg-type]

    # -- who is on the way ----------------------------------------------------------------------

    def bound(self, layer: int) -> float:
        """Seconds a batch of ``layer`` waits for its members at most: ``min(wait, cost)``, the cost
        being the moving average of the wall time of that layer's last steps (``wait`` before the
        first). Waiting longer than a step costs would cost the members more than the straggler's
        own step."""
        cost = self._cost.get(self._index[layer])
        return self.wait if cost is None else min(self.wait, cost)

    def _expected(self, stream: DecodeStream, batch: _Batch[R], now: float) -> bool:
        if stream._in_forward:  # at most one MoE step away (its attention, or one step and attention)
            if batch.index == 0 and stream._position >= len(self._index):
                return True  # past its last MoE layer: the output head, then this token's first layer
            return batch.index - 2 < stream._position <= batch.index
        return batch.index == 0 and now - stream._ended < batch.bound  # between two tokens

    def _complete(self, batch: _Batch[R], now: float) -> bool:
        inside = {m.stream for m in batch.members}
        return not any(s not in inside and self._expected(s, batch, now) for s in self._streams)

    def _recheck(self) -> None:
        now = time.monotonic()
        for s in [s for s in self._streams if not s._in_forward and now - s._ended >= self.wait]:
            del self._streams[s]  # ended a while ago: forgotten until its next forward pass
        for batch in self._open.values():
            if not batch.full.is_set() and self._complete(batch, now):
                batch.full.set()

    # -- one call -------------------------------------------------------------------------------

    async def submit(self, layer: int, request: R, stream: DecodeStream | None) -> T:
        """Run ``request`` in the batch of ``layer`` (opening one if none is open) and return its result.

        Raises:
            What running the request raises (alone, if its batch failed as a whole).
        """
        index = self._index[layer]
        if stream is not None:
            stream._position = index
        now = time.monotonic()
        batch = self._open.get(layer)
        me: _Member[R] = _Member(request, stream)
        self.note("arrive", layer, -1 if stream is None else stream._number)
        if batch is None:
            bound = self.bound(layer)
            batch = self._open[layer] = _Batch(layer, index, now + bound, bound)
            batch.leader = me
        batch.members.append(me)
        if self.max_calls is not None and len(batch.members) >= self.max_calls:
            del self._open[layer]  # full: the next call of this layer opens a batch of its own
            batch.full.set()
        elif self._complete(batch, now):
            batch.full.set()
        try:
            while not me.finished:
                if batch.leader is me and not batch.started:
                    await self._lead(batch)
                else:
                    await me.wake.wait()
        except BaseException:
            self._leave(batch, me)
            raise
        finally:
            if stream is not None:
                stream._position = index + 1
                self._recheck()
        outcome = me.outcome
        if outcome is _RETRY:
            self.counters.retried_calls += 1
            (outcome,) = await self._run(layer, [request])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome  # type: ignore[return-value]

    def _leave(self, batch: _Batch[R], me: _Member[R]) -> None:
        """A cancelled (or failed) member: out of a batch not started yet; else its result is dropped."""
        me.cancelled = True
        if batch.started:
            return
        batch.members.remove(me)
        if batch.leader is me:
            batch.leader = batch.members[0] if batch.members else None
            if batch.leader is None:
                if self._open.get(batch.layer) is batch:
                    del self._open[batch.layer]
            else:
                batch.leader.wake.set()  # the next member leads (the window keeps its deadline)

    async def _lead(self, batch: _Batch[R]) -> None:
        t0 = time.monotonic()
        while not batch.full.is_set():
            now = time.monotonic()
            if now >= batch.deadline or self._complete(batch, now):
                break
            # a stream between two tokens stops being expected at its own time: look again then
            until = batch.deadline
            if batch.index == 0:
                for s in self._streams:
                    expiry = s._ended + batch.bound
                    if not s._in_forward and now < expiry < until:
                        until = expiry
            with anyio.move_on_after(until - now):
                await batch.full.wait()
        batch.started = True
        if self._open.get(batch.layer) is batch:
            del self._open[batch.layer]
        members = [m for m in batch.members if not m.cancelled]
        c = self.counters
        c.window_seconds += time.monotonic() - t0
        if len(members) > 1:
            c.batches += 1
            c.batched_calls += len(members)
        outcomes: list[object]
        self.note("start", batch.layer, len(members))
        try:
            # the others' step runs here: a cancelled leader finishes it first (one layer step),
            # then the cancellation is delivered at its next checkpoint
            with anyio.CancelScope(shield=len(members) > 1):
                t1 = time.monotonic()
                try:
                    outcomes = list(await self._run(batch.layer, [m.request for m in members]))
                except Exception as exc:
                    outcomes = [exc] if len(members) == 1 else [_RETRY] * len(members)
                else:
                    cost = self._cost.get(batch.index)
                    took = time.monotonic() - t1
                    self._cost[batch.index] = took if cost is None else cost + COST_SMOOTHING * (took - cost)
                self.note("done", batch.layer, len(members))
            for m, outcome in zip(members, outcomes, strict=True):
                m.outcome, m.finished = outcome, True
        finally:
            for m in batch.members:
                if not m.finished and m is not batch.leader:  # the leader raised: the others go alone
                    m.outcome, m.finished = _RETRY, True
                m.wake.set()
        await anyio.lowlevel.checkpoint_if_cancelled()  # a leader cancelled during the step: its rows are dropped
