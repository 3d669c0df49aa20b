"""The fault matrix of the I/O core: every single fault, at several places of a batch, on every loop.

Each case builds the core (files, slab, backend, scheduler, cache) on the running loop, warms it
up (the ring's submission queue wraps, the slab fills), arms one fault and runs one round of
requests through the cache API: overlapping demand requests, a waiting request and prefetches.
After the round it checks the invariants of docs/architecture.md:

- no slot was read into while another load owned it (the backend's slot guard), and no read
  entry reached the kernel for a read the scheduler no longer counted (the ring proxy);
- every waiter was answered, with the right bytes or an ``AioExpertsError``, within a bound;
- pins, reads and bytes in flight back to zero, every slot either free or held by one entry;
- every expert's bytes right on the next request (unless the case closed the cache);
- after close, nothing submitted any more, and as many file descriptors open as before the case.

Backends: ``fake`` (a scripted fake) and ``uring`` (the real io_uring backend through a
fault-injecting proxy of ``liburing``). Loops: asyncio, uvloop and trio (``anyio_backend``).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aioexperts._io.backends.uring import UringBackend
from faults.arming import CORE_CASES, Case, arm_fault, params
from faults.guard import CheckedUring, SlotGuard, checked_factory
from faults.policy import OnceFaulty
from faults.ringproxy import RingFaults
from faults.script import FaultyFake, ReadFault
from faults.stack import Key, Stack, open_fds, open_stack

pytestmark = pytest.mark.anyio

SLOTS = 8
DEPTH = 32
WARM_UP: list[list[Key]] = [[(2, e) for e in range(4)], [(2, e) for e in range(4, 8)], [(1, e) for e in range(2, 8)]]
#: The round: two demand requests that overlap (one with a hit on a warm-up expert), one that
#: waits for slots, two prefetches: seven new experts, the eight slots all used.
DEMAND: list[list[Key]] = [[(0, 0), (0, 1), (0, 2)], [(0, 2), (0, 3), (1, 7)]]
WAITING: list[Key] = [(0, 1), (0, 4)]
PREFETCH: list[Key] = [(1, 0), (1, 1)]
FIRST_BATCH = 3 * 7  # reads of the round's new experts (first / middle / last are taken from this)


class Run:
    """One case in progress: the stack, the ring proxy, what was armed and how to see it fired."""

    def __init__(self, case: Case, backend: str, at: str, ring: RingFaults) -> None:
        self.case, self.backend_kind, self.at, self.ring = case, backend, at, ring
        self.policy = OnceFaulty(case.name.split()[1] if case.name.startswith("policy") else None)
        self.read_fault: ReadFault | None = None
        self.fired: Callable[[], bool] = lambda: True
        self.holder: dict[str, Any] = {}
        self.stack: Stack | None = None
        self.expect_unexpected = False
        self.submits_at_close: int | None = None

    @property
    def guard(self) -> SlotGuard:
        backend = self.holder["backend"]
        assert isinstance(backend, SlotGuard)
        return backend

    def factory(self) -> Callable[..., Any]:
        if self.backend_kind == "fake":
            order = "reverse" if self.case.name == "completions out of order" else "fifo"
            return checked_factory(FaultyFake, self.holder, order=order)
        if self.case.name == "registration ENOMEM":
            self.ring.register_buffers_error = OSError(errno.ENOMEM, "Cannot allocate memory")
        if self.case.name == "no probe":
            self.ring.probe_error = RuntimeError("io_uring_get_probe_ring: not supported by this kernel")
        return checked_factory(CheckedUring, self.holder)

    def arm(self, stack: Stack) -> None:
        """Arm the case's fault for the round (call after the warm-up)."""
        name, ring, at = self.case.name, self.ring, self.at
        fake = self.holder["backend"] if self.backend_kind == "fake" else None
        armed = arm_fault(name, at, fake, ring, self.policy, FIRST_BATCH)
        self.fired, self.read_fault, self.expect_unexpected = armed.fired, armed.read_fault, armed.expect_unexpected

        guard = self.guard

        def close() -> None:
            stack.cache.close()
            self.submits_at_close = len(guard.submitted)

        if name == "close during in-flight reads":
            loop = stack.cache.loop

            def close_after_submit(ops: Any, taken: int) -> None:
                guard.after_submit = None
                loop.call_soon(close)  # right after this flush: every read is in flight

            guard.after_submit = close_after_submit
        elif name == "close during a failed submit":

            def close_inside_submit(ops: Any, taken: int) -> None:
                if taken < len(ops):  # the submit that failed
                    guard.after_submit = None
                    close()  # inside the flush, before it handles the failure

            guard.after_submit = close_inside_submit
        elif name == "close during a retry":
            fault = self.read_fault
            assert fault is not None

            def close_after_short_read(op: Any, result: Any) -> None:
                if fault.hits:
                    guard.after_deliver = None
                    close()  # a re-read is queued, its flush not run yet

            guard.after_deliver = close_after_short_read

    def disarm(self) -> None:
        self.ring.enabled = False
        self.policy.armed = False
        if self.backend_kind == "fake":
            fake = self.holder["backend"]
            fake.read_fault = None
            fake.submit_fault = None


async def round_of_requests(stack: Stack) -> None:
    async with anyio.create_task_group() as tg:
        for keys in DEMAND:
            tg.start_soon(stack.request, keys)
        tg.start_soon(lambda: stack.request(WAITING, wait=True))
        try:
            stack.cache.prefetch(PREFETCH)
        except Exception as exc:  # a policy fault may hit the prefetch's eviction
            stack.errors.append(exc)
            stack.outcomes.append(type(exc).__name__)


@pytest.fixture
def ring() -> Iterator[RingFaults]:
    faults = RingFaults()
    with faults.installed():
        yield faults


@pytest.mark.parametrize(("case", "backend", "at"), list(params(CORE_CASES)))
async def test_fault_matrix(
    model_path: Path,
    reference: dict[Key, list[bytes]],
    ring: RingFaults,
    case: Case,
    backend: str,
    at: str,
    anyio_backend: object,
) -> None:
    baseline = open_fds()
    run = Run(case, backend, at, ring)
    stack = open_stack(model_path, run.factory(), reference=reference, slots=SLOTS, depth=DEPTH, policy=run.policy)
    try:
        if backend == "uring":
            ring.watch(run.guard)
        for keys in WARM_UP:  # fill the slab, wrap the submission queue
            assert await stack.request(keys) == "ok"
        await stack.quiesce()
        del stack.outcomes[:]
        run.arm(stack)

        await round_of_requests(stack)
        await stack.quiesce()

        assert run.fired(), f"the fault of {case.name!r} never fired"
        assert "WRONG BYTES" not in stack.outcomes
        assert all(o == "ok" or o.endswith("Error") for o in stack.outcomes), stack.outcomes
        assert len(stack.outcomes) >= len(DEMAND) + 1
        assert stack.problems() == []
        assert ring.violations == []
        uring = stack.backend if isinstance(stack.backend, UringBackend) else None
        if case.name in ("registration ENOMEM", "no probe"):
            assert uring is not None and uring.features()["fixed_buffers"] is False
        if case.closes:
            assert stack.cache.closed and stack.scheduler.closed
            assert len(run.guard.submitted) == run.submits_at_close, "a read was submitted after close"
        else:
            run.disarm()
            assert await stack.verify_all() == []
            await stack.quiesce()
            assert stack.problems() == [] and ring.violations == []
            if uring is not None:
                assert uring.queued_entries == 0 and uring.nops_in_flight == 0
                assert (uring.unexpected_completions > 0) == run.expect_unexpected
    finally:
        with anyio.CancelScope(shield=True):
            await stack.aclose()
    assert open_fds() == baseline
