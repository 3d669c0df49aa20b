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

:class:`StepBatcher` is this policy on the one batcher of the package
(:class:`aioexperts._batcher.Batcher`, one key, one batch at a time), which owns the mechanics: the
step runs in the task of its first call (the leader); a call cancelled before its step starts
leaves (a leader hands over); one cancelled during the step has its result dropped (its rows are
still computed: the run keeps what it writes alive); a leader cancelled during a step of several
calls finishes the step first (one token's step); a step that fails as a whole is run again call by
call.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Hashable, Sequence
from typing import TypeVar

from aioexperts._batcher import Batcher

__all__ = ("SETTLE_TURNS", "StepBatcher")

R = TypeVar("R")
T = TypeVar("T")

SETTLE_TURNS = 4
"""Scheduler turns a step's leader yields before it looks who is there (calls woken together)."""

#: ``run(requests) -> outcomes``: one result (or the exception of that request) per request;
#: raising fails the step as a whole (each request is then run alone).
RunSteps = Callable[[list[R]], Awaitable[Sequence["T | Exception"]]]


class StepBatcher(Batcher[None, R, T]):
    """One step at a time for all the calls waiting (module docstring).

    Args:
        run: runs the requests of one step (``RunSteps``).
        max_calls: calls one step takes at most.
        wait: the window in seconds.

    Raises:
        ConfigError: ``max_calls`` is not an int >= 1.
    """

    def __init__(self, run: RunSteps[R, T], max_calls: int, wait: float) -> None:
        async def run_step(_key: None, requests: list[R]) -> Sequence[T | Exception]:
            return await run(requests)

        super().__init__(run_step, wait=wait, max_calls=max_calls, one_at_a_time=True, settle_turns=SETTLE_TURNS)
        self._recent: dict[Hashable, float] = {}  # key -> when its last step ended

    async def submit(self, key: Hashable, request: R) -> T:
        """Run ``request`` in the next step and return its result.

        Args:
            key: the calling sequence (one call per key at a time).
            request: what ``run`` takes.

        Raises:
            What running the request raises (alone, if its step failed as a whole).
        """
        return await self.join(None, request, key)

    def forget(self, key: Hashable) -> None:
        """``key`` will not come back (its sequence closed or stopped): no step waits for it."""
        if self._recent.pop(key, None) is not None:
            self.look()

    # -- the policy's hooks ----------------------------------------------------------------------

    def _complete(self, key: None, callers: Collection[Hashable], window: float, now: float) -> bool:
        """No sequence that ended a step within the window is missing."""
        for caller, ended in list(self._recent.items()):
            if now - ended >= self.wait:
                del self._recent[caller]  # gone a while: forgotten until its next step
            elif caller not in callers:
                return False
        return True

    def _ran(self, key: None, callers: list[Hashable], seconds: float | None) -> None:
        now = time.monotonic()
        for caller in callers:
            self._recent[caller] = now
