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

:class:`LayerBatcher` is this policy on the one batcher of the package (:class:`aioexperts._batcher.Batcher`,
keyed by layer, batches of a layer pipelined), which owns the mechanics: the batch runs in the task of
its first call (its leader); a call cancelled before the start leaves the batch (a leader hands over
to the next call); once the batch has started its rows are still computed (the slots stay pinned
until the kernels are done) but nobody takes the result; a batch that fails as a whole (a read error,
a slab too small for the union) is retried call by call, so one call's bad expert never fails
another call's step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Hashable, Sequence
from typing import TypeVar

from ._batcher import Batcher, RunBatch
from ._errors import ConfigError

__all__ = ("DEFAULT_BATCH_WAIT", "DecodeStream", "LayerBatcher", "check_batch_wait")

DEFAULT_BATCH_WAIT = 0.05
"""Seconds a batch of decode steps stays open for the other streams at most (the window); the
wait of a layer is also bounded by what its step costs (:meth:`LayerBatcher.bound`)."""

COST_SMOOTHING = 0.5
"""Weight of the newest step in a layer's moving average of step wall time (the wait bound)."""

TRACE_MAX_EVENTS = 1 << 16
"""Events a timeline (:meth:`LayerBatcher.record_timeline`) keeps at most (the first ones)."""

R = TypeVar("R")
T = TypeVar("T")


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


class LayerBatcher(Batcher[int, R, T]):
    """The batcher keyed by MoE layer: concurrent calls of one layer in one step (module docstring).

    Args:
        wait: the window in seconds (0: the runner does not batch).
        run: runs a list of requests of one layer (see ``RunBatch``).
        max_calls: calls a batch takes at most (None: no cap); a full batch starts at once and
            the layer's next calls go in the next one, which gathers while it runs.

    Raises:
        ConfigError: ``max_calls`` is not None or an int >= 1.
    """

    def __init__(self, wait: float, run: RunBatch[int, R, T], max_calls: int | None = None) -> None:
        super().__init__(run, wait=wait, max_calls=max_calls)
        self._index: dict[int, int] = {}
        self._streams: dict[DecodeStream, None] = {}
        self._made = 0
        self._cost: dict[int, float] = {}  # layer index -> moving average of a step's wall seconds
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

    async def submit(self, layer: int, request: R, stream: DecodeStream | None) -> T:
        """Run ``request`` in the batch of ``layer`` (joining the one gathering, or opening one) and
        return its result.

        Raises:
            What running the request raises (alone, if its batch failed as a whole).
        """
        if stream is not None:
            stream._position = self._index[layer]
        self.note("arrive", layer, -1 if stream is None else stream._number)
        return await self.join(layer, request, stream)

    # -- who is on the way (the policy's hooks) -----------------------------------------------------

    def bound(self, layer: int) -> float:
        """Seconds a batch of ``layer`` waits for its members at most: ``min(wait, cost)``, the cost
        being the moving average of the wall time of that layer's last steps (``wait`` before the
        first). Waiting longer than a step costs would cost the members more than the straggler's
        own step."""
        cost = self._cost.get(self._index[layer])
        return self.wait if cost is None else min(self.wait, cost)

    def _window(self, key: int) -> float:
        return self.bound(key)

    def _expected(self, stream: DecodeStream, index: int, bound: float, now: float) -> bool:
        if stream._in_forward:  # at most one MoE step away (its attention, or one step and attention)
            if index == 0 and stream._position >= len(self._index):
                return True  # past its last MoE layer: the output head, then this token's first layer
            return index - 2 < stream._position <= index
        return index == 0 and now - stream._ended < bound  # between two tokens

    def _complete(self, key: int, callers: Collection[Hashable], window: float, now: float) -> bool:
        index = self._index[key]
        return not any(s not in callers and self._expected(s, index, window, now) for s in self._streams)

    def _look_again(self, key: int, window: float, now: float) -> float:
        # a stream between two tokens stops being expected at its own time: look again then
        until = math.inf
        if self._index[key] == 0:
            for s in self._streams:
                expiry = s._ended + window
                if not s._in_forward and now < expiry < until:
                    until = expiry
        return until

    def _recheck(self) -> None:
        now = time.monotonic()
        for s in [s for s in self._streams if not s._in_forward and now - s._ended >= self.wait]:
            del self._streams[s]  # ended a while ago: forgotten until its next forward pass
        self.look()

    def _waited(self, key: int, caller: Hashable) -> None:
        if isinstance(caller, DecodeStream):
            caller._position = self._index[key] + 1
            self._recheck()

    def _starting(self, key: int, n: int) -> None:
        self.note("start", key, n)

    def _ran(self, key: int, callers: list[Hashable], seconds: float | None) -> None:
        if seconds is not None:
            index = self._index[key]
            cost = self._cost.get(index)
            self._cost[index] = seconds if cost is None else cost + COST_SMOOTHING * (seconds - cost)
        self.note("done", key, len(callers))
