"""Cross-request expert batching: the MoE steps of sequences decoding at the same moment, taken together.

Each decoding sequence is a :class:`DecodeStream` of the runner; while its forward pass runs, the
batcher knows which MoE layer it goes to next. A call for layer ``L`` opens a batch there (or joins
the open one); the batch starts as soon as no other stream is on its way to ``L`` (a stream at ``L``
or an earlier layer of this token, or one that ended a token moments ago when ``L`` is the first MoE
layer), and at the latest ``wait`` seconds after it opened: a lone caller never waits, a caller never
waits beyond the window. Streams drift into step by themselves: one that is ahead waits for those
behind, once.

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

from ._errors import ConfigError

__all__ = ("DEFAULT_BATCH_WAIT", "BatchCounters", "DecodeStream", "LayerBatcher", "check_batch_wait")

DEFAULT_BATCH_WAIT = 0.05
"""Seconds a batch of decode steps stays open for the other streams at most (the window)."""

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

    __slots__ = ("_batcher", "_ended", "_in_forward", "_position")

    def __init__(self, batcher: LayerBatcher[object, object]) -> None:
        self._batcher = batcher
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
    members: list[_Member[R]] = field(default_factory=list)
    leader: _Member[R] | None = None
    full: anyio.Event = field(default_factory=anyio.Event)
    started: bool = False


class LayerBatcher(Generic[R, T]):
    """Gathers concurrent calls of one layer into one step (module docstring).

    Args:
        wait: the window in seconds (0: the runner does not batch).
        run: runs a list of requests of one layer (see ``RunBatch``).
    """

    def __init__(self, wait: float, run: RunBatch[R, T]) -> None:
        self.wait = wait
        self._index: dict[int, int] = {}
        self._run = run
        self._open: dict[int, _Batch[R]] = {}
        self._streams: dict[DecodeStream, None] = {}
        self.counters = BatchCounters()

    def set_layers(self, layers: Sequence[int]) -> None:
        """The MoE layers in the order a token goes through them (before the first :meth:`submit`)."""
        self._index = {layer: i for i, layer in enumerate(layers)}

    def stream(self) -> DecodeStream:
        """A new stream (no resources: it counts only inside its ``forward()`` and just after)."""
        return DecodeStream(self)  # type: ignore[arg-type]

    # -- who is on the way ----------------------------------------------------------------------

    def _expected(self, stream: DecodeStream, index: int, now: float) -> bool:
        if stream._in_forward:
            return stream._position <= index
        return index == 0 and now - stream._ended < self.wait  # between two tokens

    def _complete(self, batch: _Batch[R], now: float) -> bool:
        inside = {m.stream for m in batch.members}
        return not any(s not in inside and self._expected(s, batch.index, now) for s in self._streams)

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
        if batch is None:
            batch = self._open[layer] = _Batch(layer, index, now + self.wait)
            batch.leader = me
        batch.members.append(me)
        if self._complete(batch, now):
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
        if not batch.full.is_set():
            with anyio.move_on_after(max(0.0, batch.deadline - t0)):
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
        try:
            # the others' step runs here: a cancelled leader finishes it first (one layer step),
            # then the cancellation is delivered at its next checkpoint
            with anyio.CancelScope(shield=len(members) > 1):
                try:
                    outcomes = list(await self._run(batch.layer, [m.request for m in members]))
                except Exception as exc:
                    outcomes = [exc] if len(members) == 1 else [_RETRY] * len(members)
            for m, outcome in zip(members, outcomes, strict=True):
                m.outcome, m.finished = outcome, True
        finally:
            for m in batch.members:
                if not m.finished and m is not batch.leader:  # the leader raised: the others go alone
                    m.outcome, m.finished = _RETRY, True
                m.wake.set()
        await anyio.lowlevel.checkpoint_if_cancelled()  # a leader cancelled during the step: its rows are dropped
