"""The fault matrix at the level of the public objects: ``aioexperts.open`` -> ``ExpertStore``, ``MoERunner``.

Every case opens a real store (``aioexperts.open(path, io=IOOptions(backend=checked_factory(...)))``)
on the running loop (asyncio, uvloop, trio: ``anyio_backend``), through the scripted fake backend or
the real io_uring backend under the fault-injecting ``liburing`` proxy, and checks the invariants
of docs/architecture.md after the case (:mod:`faults.storekit`):

- no slot read into while another load owns it, nothing submitted after close (the slot guard), no
  read entry handed to the kernel for a read no longer in flight (the ring proxy);
- every request answered within a bound: views with the right bytes, an ``moe`` output equal to
  the fault-free one, or an ``AioExpertsError``;
- ``statistics()``: no pinned slot, no read in flight, the request counters add up;
- every expert's bytes right on the next request (a whole slab at a time, so a lost slot shows);
- after ``aclose()``: descriptors and io_uring mappings back to their count before ``open``, the
  slab unmapped, the backend closed.

Sections: the fault matrix (one fault per case, at the first, middle or last read of a batch);
cancellation at every await point of ``experts()``, ``moe()`` and ``aclose()`` (anyio cancel
scopes on every loop, plain ``Task.cancel()`` and ``asyncio.wait_for`` on asyncio and uvloop);
1000 tasks with seeded random cancellations; regression tests for what this matrix found.
"""

from __future__ import annotations

import errno
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import pytest

import aioexperts
from aioexperts._io.backends.uring import UringBackend
from faults.arming import CORE_CASES, Case, arm_fault, params
from faults.guard import CheckedRawUring, CheckedUring, SlotGuard
from faults.policy import OnceFaulty
from faults.ringproxy import RingFaults
from faults.script import FaultyFake, ReadFault
from faults.stack import Key
from faults.stepper import Stepper, cancellation_point
from faults.storekit import BOUND, MoEReference, StoreRun, moe_references

pytestmark = pytest.mark.anyio

SLOTS = 8
DEPTH = 32
SEEDS = (0, 1)
#: Fill the slab and wrap the io_uring submission queue (32 entries) before the fault.
WARM_UP: list[tuple[int, list[int]]] = [(2, [0, 1, 2, 3]), (2, [4, 5, 6, 7]), (1, [2, 3, 4, 5, 6, 7])]
#: The round: two overlapping demand requests that do not wait, a hit, a request that waits for
#: slots, a prefetch and one MoE layer (routing, its own reads, prefetches of the next layers).
DEMAND: list[tuple[int, list[int]]] = [(0, [0, 1, 2]), (0, [2, 3])]
HIT = (1, [7])
WAITING = (0, [1, 4])
PREFETCH: list[Key] = [(1, 0), (1, 1)]
MOE = (2, 0)  # layer, seed of x
FIRST_BATCH = 3 * 7  # reads of the round's first submission (first / middle / last are taken from this)


@pytest.fixture(scope="module")
def moe_refs(model_path: Path) -> MoEReference:
    return moe_references(model_path, SEEDS)


@pytest.fixture
def ring() -> Iterator[RingFaults]:
    faults = RingFaults()
    with faults.installed():
        yield faults


# -- the fault matrix --------------------------------------------------------------------------------


#: The core matrix's cases, and those only the store level has.
CASES = [
    *CORE_CASES,
    Case("submit raises outside the contract", ("fake",)),  # a bare RuntimeError, not a SubmitError
    Case("two closes at once", positioned=False, closes=True),
    Case("ring exit raises at close", ("uring",), positioned=False),
]


class CaseRun:
    """One case in progress: what was armed, how to see that it fired, and the closers it started."""

    def __init__(self, case: Case, backend: str, at: str, ring: RingFaults) -> None:
        self.case, self.backend_kind, self.at, self.ring = case, backend, at, ring
        self.policy = OnceFaulty(case.name.split()[1] if case.name.startswith("policy") else None)
        self.read_fault: ReadFault | None = None
        self.fired: Any = lambda: True
        self.expect_unexpected = False
        self.tg: anyio.abc.TaskGroup | None = None
        self.run: StoreRun | None = None
        self.closers = 0
        self.submits_at_close: int | None = None
        self.close_done = anyio.Event()

    def backend_args(self) -> tuple[type[SlotGuard], dict[str, Any]]:
        if self.backend_kind == "fake":
            return FaultyFake, {"order": "reverse" if self.case.name == "completions out of order" else "fifo"}
        if self.case.name == "registration ENOMEM":
            self.ring.register_buffers_error = OSError(errno.ENOMEM, "Cannot allocate memory")
        if self.case.name == "no probe":
            self.ring.probe_error = RuntimeError("io_uring_get_probe_ring: not supported by this kernel")
        return CheckedUring, {}

    # -- closing from inside the round ------------------------------------------------------------

    def start_close(self) -> None:
        """Start an ``aclose()`` in a task of the round (from a backend hook: it runs a little later)."""
        assert self.tg is not None and self.run is not None
        self.closers += 1
        self.tg.start_soon(self._closer)

    async def _closer(self) -> None:
        run = self.run
        assert run is not None
        guard = run.backend
        if self.submits_at_close is None:
            self.submits_at_close = len(guard.submitted)  # aclose closes the scheduler before it first awaits
        if isinstance(run.backend, FaultyFake) and not run.backend.auto:
            assert self.tg is not None
            self.tg.start_soon(self._complete_until_closed, run.backend)
        with anyio.fail_after(BOUND):
            await run.store.aclose()
        self.close_done.set()

    async def _complete_until_closed(self, fake: FaultyFake) -> None:
        with anyio.fail_after(BOUND):
            while not self.close_done.is_set():
                fake.complete_all()
                await anyio.lowlevel.checkpoint()

    # -- arming -----------------------------------------------------------------------------------

    def arm(self, run: StoreRun) -> None:
        """Arm the case's fault for the round (after the warm-up)."""
        self.run = run
        name, ring, at = self.case.name, self.ring, self.at
        guard = run.backend
        fake = guard if self.backend_kind == "fake" else None
        armed = arm_fault(name, at, fake, ring, self.policy, FIRST_BATCH)
        self.fired, self.read_fault, self.expect_unexpected = armed.fired, armed.read_fault, armed.expect_unexpected

        if name == "close during in-flight reads":
            if fake is not None:
                fake.auto = False  # the reads stay in flight until the close has begun

            def close_after_submit(ops: Any, taken: int) -> None:
                guard.after_submit = None
                self.start_close()

            guard.after_submit = close_after_submit
        elif name == "two closes at once":
            guard.close_delay = 0.02  # the first release is still running when the second close wants one

            def close_twice(ops: Any, taken: int) -> None:
                guard.after_submit = None
                self.start_close()
                self.start_close()

            guard.after_submit = close_twice
        elif name == "close during a failed submit":

            def close_after_failed_submit(ops: Any, taken: int) -> None:
                if taken < len(ops):
                    guard.after_submit = None
                    self.start_close()

            guard.after_submit = close_after_failed_submit
        elif name == "close during a retry":
            fault = self.read_fault
            assert fault is not None

            def close_before_the_retry(op: Any, result: Any) -> None:
                if fault.hits:  # the short read is about to be delivered: its re-read is queued next
                    guard.before_deliver = None
                    self.start_close()

            guard.before_deliver = close_before_the_retry

    def disarm(self) -> None:
        self.ring.enabled = False
        self.policy.armed = False
        if self.backend_kind == "fake":
            assert self.run is not None
            fake = self.run.backend
            fake.read_fault = None
            fake.submit_fault = None


async def round_of_requests(run: StoreRun, ctx: CaseRun) -> None:
    async with anyio.create_task_group() as tg:
        ctx.tg = tg
        for layer, ids in DEMAND:
            tg.start_soon(run.request, layer, ids, False)
        tg.start_soon(run.request, *HIT, False)
        tg.start_soon(run.request, *WAITING, True)
        tg.start_soon(run.moe, *MOE)
        tg.start_soon(prefetch, run)  # last: the first batch holds the demand reads (asyncio, uvloop)


async def prefetch(run: StoreRun) -> None:
    try:
        run.store.prefetch(PREFETCH)
    except aioexperts.AioExpertsError as exc:  # a policy fault may hit the prefetch's eviction
        run.record(type(exc).__name__, exc)


@pytest.mark.parametrize(("case", "backend", "at"), list(params(CASES)))
async def test_store_fault_matrix(
    model_path: Path,
    reference: dict[Key, list[bytes]],
    moe_refs: MoEReference,
    ring: RingFaults,
    case: Case,
    backend: str,
    at: str,
    anyio_backend: object,
) -> None:
    ctx = CaseRun(case, backend, at, ring)
    backend_cls, kwargs = ctx.backend_args()
    run = await StoreRun.open(
        model_path, backend_cls, reference, moe_refs, slots=SLOTS, depth=DEPTH, policy=ctx.policy, **kwargs
    )
    try:
        if backend == "uring":
            ring.watch(run.backend)
        await run.runner.warmup()
        for layer, ids in WARM_UP:
            assert await run.request(layer, ids) == "ok"
        await run.quiesce()
        del run.outcomes[:]
        run.note_slab()
        ctx.arm(run)

        await round_of_requests(run, ctx)

        assert ctx.fired(), f"the fault of {case.name!r} never fired"
        assert len(run.outcomes) >= len(DEMAND) + 3
        if case.closes:
            assert ctx.closers and ctx.close_done.is_set() and run.store.closed
            assert len(run.backend.submitted) == ctx.submits_at_close, "a read was submitted after close"
            assert run.backend.close_calls == 1, "the backend was released more than once"
            assert run.problems() == [] and ring.violations == []
            assert run.leftovers() == []
            return
        await run.quiesce()
        assert run.problems() == []
        assert ring.violations == []
        uring = run.backend if isinstance(run.backend, UringBackend) else None
        if case.name in ("registration ENOMEM", "no probe"):
            assert run.store.statistics().backend_features["fixed_buffers"] is False
        ctx.disarm()
        assert await run.verify_all() == []
        await run.quiesce()
        assert run.problems() == [] and ring.violations == []
        if uring is not None:
            assert uring.queued_entries == 0 and uring.nops_in_flight == 0
            assert (uring.unexpected_completions > 0) == ctx.expect_unexpected
        if case.name == "ring exit raises at close":
            run.note_slab()
            ring.enabled = True
            ring.fail_call("io_uring_queue_exit", RuntimeError("scripted: after the ring exit"), after=True)
            with pytest.raises(RuntimeError, match="after the ring exit"):
                await run.store.aclose()
            assert run.leftovers() == []  # the files and the slab were released all the same
            await run.store.aclose()  # again: nothing left to do, no error
            assert run.leftovers() == []
            return
        assert await run.close_and_check() == []
    finally:
        await run.close_if_open()


# -- cancellation at every await point -------------------------------------------------------------

#: The two asyncio loops, for what only asyncio has (``Task.cancel()``, ``asyncio.wait_for``).
ASYNCIO_LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]
#: A call is cancelled at its n-th suspension for n = 1, 2, ... until it completes first; a call
#: that needs more suspensions than this is a failure (a loop that never ends).
MAX_STEPS = 200


class Env:
    """A store on the fake backend in manual mode, background requests, and a driver task.

    The driver completes the oldest pending read at every loop tick and sets :attr:`release` (the
    background holders let go) from tick :attr:`release_at` on; :attr:`frozen` stops it.
    """

    def __init__(self, run: StoreRun, tg: anyio.abc.TaskGroup) -> None:
        self.run, self.tg = run, tg
        self.fake: FaultyFake = run.backend
        self.frozen = False
        self.stopped = False
        self.tick = 0
        self.release_at: int | None = None
        self.release = anyio.Event()
        self.started = 0
        self.background: list[str] = []

    async def hold(self, layer: int, ids: list[int], wait: bool | None = None) -> None:
        """A background request that holds its experts until :attr:`release` is set."""
        self.started += 1
        outcome = "ok"
        try:
            with anyio.fail_after(BOUND):
                async with self.run.store.experts(layer, ids, wait=wait) as views:
                    if not self.run.views_right(layer, ids, views):
                        outcome = "WRONG BYTES"
                    await self.release.wait()
        except aioexperts.AioExpertsError as exc:
            outcome = type(exc).__name__
        except TimeoutError:
            outcome = "HANG"
        self.background.append(outcome)

    async def settle(self, ticks: int = 5) -> None:
        for _ in range(ticks):
            await anyio.lowlevel.checkpoint()

    async def drive(self) -> None:
        while not self.stopped:
            await anyio.lowlevel.checkpoint()
            if self.frozen:
                continue
            self.tick += 1
            if self.release_at is not None and self.tick >= self.release_at:
                self.release.set()
            if self.fake.pending:
                self.fake.complete(self.fake.pending[0])

    async def drain(self) -> None:
        """Unfreeze, let the holders go, and drive until every background request has finished."""
        self.frozen = False
        self.release.set()
        quiet = 0
        with anyio.fail_after(BOUND):
            while quiet < 3:  # queued loads and re-reads are submitted a tick later
                await anyio.lowlevel.checkpoint()
                busy = len(self.background) < self.started or self.fake.pending
                quiet = 0 if busy or self.fake.in_flight else quiet + 1
        self.stopped = True


@dataclass(frozen=True)
class Scenario:
    """A call to cancel at each of its await points, in a set-up that makes it wait at each of them.

    ``points`` are the await points (:func:`cancellation_point`) that plain ``Task.cancel()``
    must have hit over the enumeration: read off the code of the call, one per ``await`` it can
    block at in this set-up.
    """

    name: str
    slots: int
    points: frozenset[str]
    closes: bool = False

    async def setup(self, env: Env) -> None:
        store = env.run.store
        if self.name.startswith("experts"):
            if self.name == "experts wait=False":
                store.prefetch([(1, 0), (1, 1), (1, 2), (1, 3)])  # every slot loading, nobody pinning
            else:  # three experts held, one loading and held: the call waits its turn for a slot
                env.tg.start_soon(env.hold, 0, [0, 1, 2])
                env.tg.start_soon(env.hold, 0, [3], False)
                env.release_at = 14  # after the holders' 12 reads
        elif self.name.startswith("moe"):
            if self.name != "moe, cold runner":
                await env.run.runner.warmup()
        else:  # aclose: reads in flight, a request waiting for slots, a prefetch queued
            env.fake.auto = True  # one request first, to know where the slab is
            assert await env.run.request(2, [7]) == "ok"
            env.fake.auto = False
            env.run.note_slab()
            env.fake.close_delay = 0.02  # the release thread takes a while: aclose waits for it
            env.tg.start_soon(env.hold, 0, [0, 1])
            env.tg.start_soon(env.hold, 1, [0, 1, 2], True)
            store.prefetch([(2, 0)])
        await env.settle()

    async def call(self, env: Env) -> str:
        """The call; ``"ok"``, or what went wrong in it (bytes, output)."""
        run = env.run
        if self.name.startswith("experts"):
            wait = self.name != "experts wait=False"
            layer, ids = (0, [3, 4]) if wait else (0, [0, 1])
            async with run.store.experts(layer, ids, wait=wait) as views:
                if not run.views_right(layer, ids, views):
                    return "WRONG BYTES"
                await anyio.lowlevel.checkpoint()
            return "ok"
        if self.name.startswith("moe"):
            x, expected = run.moe_refs[(2, 1)]  # two tokens, four experts: two groups in a two-slot slab
            y = await run.runner.moe(2, x)
            return "ok" if np.allclose(y, expected, rtol=1e-5, atol=1e-7) else "WRONG OUTPUT"
        await run.store.aclose()
        return "ok"


SCENARIOS = [
    # _pin_in_turn: waiting for a slot; acquire: waiting for the load; outside: the body of the block
    Scenario("experts", 4, frozenset({"acquire>_pin_in_turn", "__aenter__>acquire", "outside"})),
    # _pin_now: waiting for unpinned loads to free their slots
    Scenario("experts wait=False", 4, frozenset({"acquire>_pin_now", "__aenter__>acquire", "outside"})),
    # routing in a worker, the loads, the compute in a worker (a warm runner takes no lock: no await there)
    Scenario(
        "moe",
        8,
        frozenset({"moe_result>run_in_worker", "__aenter__>acquire", "_run_calls>run_in_worker"}),
    ),
    # and the resident weights loaded in a worker
    Scenario(
        "moe, cold runner",
        8,
        frozenset(
            {"warmup>run_in_worker", "moe_result>run_in_worker", "__aenter__>acquire", "_run_calls>run_in_worker"}
        ),
    ),
    # two groups: the second group's loads, and the sum of the groups in a worker
    Scenario(
        "moe, two groups",
        2,
        frozenset(
            {
                "moe_result>run_in_worker",
                "__aenter__>acquire",
                "run_layer_step>run_in_worker",
                "_run_groups>run_in_worker",
            }
        ),
    ),
    # waiting for the reads in flight, waiting for the release thread
    # (the release wait has no package frame below aclose: the shielded wait is a pass-through)
    Scenario("aclose", 4, frozenset({"aclose>wait_idle", "aclose"}), closes=True),
]


@dataclass
class Attempt:
    """One cancellation: how the call ended and where the cancellation hit."""

    outcome: str = "not run"
    point: str = ""
    steps: int = 0


async def cancel_at(
    path: Path,
    reference: dict[Key, list[bytes]],
    moe_refs: MoEReference,
    scenario: Scenario,
    kind: str,
    n: int,
) -> Attempt:
    """Run ``scenario`` once, cancelling its call at suspension ``n`` by ``kind``; check everything after."""
    run = await StoreRun.open(path, FaultyFake, reference, moe_refs, slots=scenario.slots, auto=False)
    attempt = Attempt()
    cancelled = anyio.get_cancelled_exc_class()
    try:
        async with anyio.create_task_group() as tg:
            env = Env(run, tg)
            await scenario.setup(env)
            tg.start_soon(env.drive)
            if kind == "scope":
                with anyio.CancelScope() as scope:
                    stepper = Stepper(scenario.call(env), lambda k: scope.cancel() if k == n else None)
                    try:
                        with anyio.fail_after(BOUND):
                            attempt.outcome = await stepper
                    except cancelled as exc:
                        attempt.point = cancellation_point(exc)
                        raise
                if scope.cancelled_caught:
                    attempt.outcome = "cancelled"
            else:
                import asyncio

                stepper = Stepper(scenario.call(env), lambda k: None)
                task = asyncio.current_task()  # replaced below by the call's own task

                def at_step(k: int) -> None:
                    if k == n:
                        if kind == "task":
                            task.cancel()
                        else:  # wait_for: stop the world here; the timeout cancels wherever the call waits
                            env.frozen = True

                stepper.at_step = at_step

                async def call() -> str:
                    try:
                        return await stepper  # type: ignore[no-any-return]
                    except asyncio.CancelledError as exc:
                        attempt.point = cancellation_point(exc)
                        raise

                task = asyncio.get_running_loop().create_task(call())
                if kind == "wait_for":
                    tg.start_soon(unfreeze_when_cancelled, env, task)
                try:
                    with anyio.fail_after(BOUND):
                        if kind == "task":
                            attempt.outcome = await asyncio.shield(task)
                        else:
                            attempt.outcome = await asyncio.wait_for(task, timeout=0.01)
                except asyncio.CancelledError:
                    if not task.cancelled():
                        raise
                    attempt.outcome = "cancelled"
                except TimeoutError:
                    if not task.cancelled():
                        raise
                    attempt.outcome = "timed out"
            attempt.steps = stepper.steps
            await env.drain()
        assert all(o in ("ok", "StoreClosedError") for o in env.background), env.background
        assert run.problems() == []
        if scenario.closes:
            assert run.store.closed and run.leftovers() == []
            await run.store.aclose()  # again: harmless
        else:
            run.backend.auto = True
            assert await run.verify_all() == []
            await run.quiesce()
            assert run.problems() == []
            assert await run.close_and_check() == []
    finally:
        if not run.store.closed:
            run.backend.auto = True
            run.backend.complete_all()
            with anyio.CancelScope(shield=True), anyio.fail_after(BOUND):
                await run.store.aclose()
    return attempt


async def unfreeze_when_cancelled(env: Env, task: Any) -> None:
    """``asyncio.wait_for`` cancelled the call (or it finished): let the driver go on."""
    with anyio.fail_after(BOUND):
        while not (task.done() or task.cancelling()):
            await anyio.sleep(0.001)
    env.frozen = False


async def enumerate_cancellations(
    path: Path, reference: dict[Key, list[bytes]], moe_refs: MoEReference, scenario: Scenario, kind: str
) -> dict[str, int]:
    """Cancel the call at suspension 1, 2, ... until it completes first; the points hit, with counts.

    ``wait_for``: the world stops at suspension n and the timeout cancels wherever the call then
    waits, for n = 1 .. the suspensions of an uncancelled run.
    """
    baseline = await cancel_at(path, reference, moe_refs, scenario, "scope", 0)  # never cancelled
    assert baseline.outcome == "ok", baseline
    points: dict[str, int] = {}
    for n in range(1, MAX_STEPS + 1):
        if kind == "wait_for" and n > baseline.steps:
            return points
        attempt = await cancel_at(path, reference, moe_refs, scenario, kind, n)
        if kind == "wait_for":
            assert attempt.outcome in ("ok", "timed out"), attempt
        else:
            assert attempt.outcome in ("ok", "cancelled"), attempt
        if attempt.outcome == "ok" and attempt.steps < n:
            return points  # every await point was tried
        if attempt.outcome != "ok":
            points[attempt.point or "after the call"] = points.get(attempt.point or "after the call", 0) + 1
    raise AssertionError(f"{scenario.name} still suspends after {MAX_STEPS} steps")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name.replace(" ", "_"))
async def test_a_cancel_scope_at_every_await_point(
    model_path: Path,
    reference: dict[Key, list[bytes]],
    moe_refs: MoEReference,
    scenario: Scenario,
    anyio_backend: object,
) -> None:
    points = await enumerate_cancellations(model_path, reference, moe_refs, scenario, "scope")
    print(scenario.name, "scope", points)
    if scenario.closes:
        assert points == {}  # aclose shields its waits: it finished the release, then the scope took effect
    else:
        assert points


@pytest.mark.parametrize("anyio_backend", ASYNCIO_LOOPS)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name.replace(" ", "_"))
async def test_task_cancel_at_every_await_point(
    model_path: Path,
    reference: dict[Key, list[bytes]],
    moe_refs: MoEReference,
    scenario: Scenario,
    anyio_backend: object,
) -> None:
    points = await enumerate_cancellations(model_path, reference, moe_refs, scenario, "task")
    print(scenario.name, "task", points)
    assert scenario.points <= set(points), f"await points never hit: {sorted(scenario.points - set(points))}"


@pytest.mark.parametrize("anyio_backend", ASYNCIO_LOOPS)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name.replace(" ", "_"))
async def test_wait_for_timeouts_at_every_await_point(
    model_path: Path,
    reference: dict[Key, list[bytes]],
    moe_refs: MoEReference,
    scenario: Scenario,
    anyio_backend: object,
) -> None:
    points = await enumerate_cancellations(model_path, reference, moe_refs, scenario, "wait_for")
    print(scenario.name, "wait_for", points)
    assert points


# -- 1000 tasks with random cancellations ----------------------------------------------------------

N_TASKS = 1000


async def one_task(run: StoreRun, rng: random.Random, how: str, outcomes: Counter[str]) -> None:
    """One ``experts()`` or ``moe()`` call, cancelled ``how``: not at all, by a cancel scope or
    ``Task.cancel()`` at a random await point, or by an ``asyncio.wait_for`` timeout."""
    wait = True
    if rng.random() < 0.7:
        layer, ids = rng.randrange(3), rng.sample(range(8), rng.randint(1, 3))
        wait, hold = rng.random() < 0.7, rng.randint(0, 3)

        def call() -> Any:
            return run.request(layer, ids, wait, hold)

    else:
        layer, seed = rng.randrange(3), rng.choice(SEEDS)

        def call() -> Any:
            return run.moe(layer, seed)

    at = rng.randint(1, 8)
    if how == "none":
        outcome = await call()
        if outcome == "SlabExhaustedError" and wait:  # it holds no pins and asks for at most 3 of 6 slots
            outcomes["SlabExhaustedError although it waits"] += 1
    elif how == "scope":
        with anyio.CancelScope() as scope:
            await Stepper(call(), lambda k: scope.cancel() if k == at else None)
        if scope.cancelled_caught:
            outcomes["cancelled"] += 1
    else:
        import asyncio

        if how == "wait_for":
            try:
                await asyncio.wait_for(call(), timeout=rng.uniform(0, 0.002))
            except TimeoutError:
                outcomes["timed out"] += 1
            return
        task = asyncio.current_task()
        inner = Stepper(call(), lambda k: task.cancel() if k == at else None)
        task = asyncio.get_running_loop().create_task(wrap(inner))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            outcomes["cancelled"] += 1


async def wrap(awaitable: Any) -> Any:
    return await awaitable


@pytest.mark.parametrize("backend", ["fake", "uring", "raw_io_uring"])
async def test_1000_tasks_with_random_cancellations(
    model_path: Path,
    reference: dict[Key, list[bytes]],
    moe_refs: MoEReference,
    ring: RingFaults,
    backend: str,
    anyio_backend: Any,
) -> None:
    rng = random.Random(7)
    kinds = ["none", "none", "scope"] if anyio_backend[0] == "trio" else ["none", "none", "scope", "task", "wait_for"]
    backend_cls: type[SlotGuard]
    backend_cls, kwargs = {
        "fake": (FaultyFake, {"order": "shuffle"}),
        "uring": (CheckedUring, {}),
        "raw_io_uring": (CheckedRawUring, {}),
    }[backend]
    run = await StoreRun.open(model_path, backend_cls, reference, moe_refs, slots=6, **kwargs)
    outcomes: Counter[str] = Counter()
    try:
        if backend == "uring":
            ring.watch(run.backend)
        await run.runner.warmup()
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(N_TASKS):
                    tg.start_soon(one_task, run, random.Random(rng.random()), rng.choice(kinds), outcomes)
                    if i % 50 == 0:
                        await anyio.lowlevel.checkpoint()  # let some finish while others start
        outcomes.update(run.outcomes)
        assert outcomes["ok"] > N_TASKS // 4 and outcomes["cancelled"] + outcomes["timed out"] > 0, outcomes
        await run.quiesce()
        assert run.problems() == [] and ring.violations == []
        allowed = {"ok", "cancelled", "timed out", "SlabExhaustedError"}  # no wait: the slab may be all pinned
        assert set(outcomes) <= allowed, outcomes
        assert await run.verify_all() == []
        await run.quiesce()
        assert run.problems() == [] and ring.violations == []
        assert await run.close_and_check() == []
    finally:
        await run.close_if_open()


# -- regressions: what this matrix found ----------------------------------------------------------


CANCEL_KINDS = [
    pytest.param("scope", ("asyncio", {}), id="scope-asyncio"),
    pytest.param("scope", ("asyncio", {"use_uvloop": True}), id="scope-uvloop"),
    pytest.param("scope", ("trio", {}), id="scope-trio"),
    pytest.param("task", ("asyncio", {}), id="task-asyncio"),
    pytest.param("task", ("asyncio", {"use_uvloop": True}), id="task-uvloop"),
    pytest.param("wait_for", ("asyncio", {}), id="wait_for-asyncio"),
]


@pytest.mark.parametrize(("kind", "anyio_backend"), CANCEL_KINDS)
async def test_a_cancelled_layer_keeps_its_experts_pinned_until_its_compute_has_finished(
    model_path: Path, reference: dict[Key, list[bytes]], moe_refs: MoEReference, kind: str, anyio_backend: object
) -> None:
    # Found by the wait_for enumeration: a plain Task.cancel() (or a wait_for timeout) while the
    # compute step ran in its worker thread unpinned the experts under it (the thread went on
    # reading slot memory that could be reused) and, with warnings as errors, turned the
    # cancellation into a ResourceWarning and left the pins behind for good.
    import threading

    run = await StoreRun.open(model_path, FaultyFake, reference, moe_refs, slots=8)
    running, finish, finished = threading.Event(), threading.Event(), threading.Event()

    def compute(layer: int, x: np.ndarray, experts: Any, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        arrays = [np.frombuffer(view.gate.data, dtype=np.uint8) for view in experts.values()]  # slot memory in use
        running.set()
        finish.wait(BOUND)
        total = sum(int(a.sum()) for a in arrays)
        finished.set()
        return x + 0 * total

    x, _ = run.moe_refs[(2, 0)]
    outcome: list[str] = []
    try:
        await run.runner.warmup()

        async def layer() -> None:
            await run.runner.run_moe_layers(x, compute=compute, prefetch=False)

        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def in_scope() -> None:
                with scope:
                    await layer()
                outcome.append("cancelled" if scope.cancelled_caught else "ok")

            if kind == "scope":
                tg.start_soon(in_scope)
            else:
                import asyncio

                task = asyncio.get_running_loop().create_task(layer())
            with anyio.fail_after(BOUND):
                while not running.is_set():
                    await anyio.sleep(0.001)
            pinned = run.store.statistics().pinned_slots
            assert pinned >= 1
            if kind == "scope":
                scope.cancel()
            elif kind == "task":
                task.cancel()
            else:
                timed_out = anyio.Event()

                async def wait_for() -> None:
                    try:
                        await asyncio.wait_for(task, timeout=0.001)
                    except TimeoutError:
                        outcome.append("timed out")
                    timed_out.set()

                tg.start_soon(wait_for)
                with anyio.fail_after(BOUND):
                    while not task.cancelling():
                        await anyio.sleep(0.001)
            for _ in range(20):  # the cancellation is in; the compute still runs
                await anyio.lowlevel.checkpoint()
            assert not finished.is_set()
            assert run.store.statistics().pinned_slots == pinned, "experts unpinned under a running compute step"
            finish.set()
            if kind == "task":
                with pytest.raises(asyncio.CancelledError):
                    await task
                outcome.append("cancelled")
        assert finished.is_set()
        assert outcome == ["timed out" if kind == "wait_for" else "cancelled"]
        assert run.problems() == []
        assert await run.verify_all() == []
        assert await run.close_and_check() == []
    finally:
        finish.set()
        await run.close_if_open()


async def test_a_view_kept_past_its_pin_with_warnings_as_errors_leaves_no_pin(
    model_path: Path, reference: dict[Key, list[bytes]], moe_refs: MoEReference, anyio_backend: object
) -> None:
    # Found by the same case: ExpertView.release() warns (ResourceWarning) when a host keeps
    # np.frombuffer arrays of slot memory past the experts() block; under warnings-as-errors (this
    # project's pytest configuration, and many applications') the warning is raised, and it used to
    # skip the unpinning: the slots stayed pinned for the life of the store.
    run = await StoreRun.open(model_path, FaultyFake, reference, moe_refs, slots=8)
    try:
        kept = []

        async def keep_past_the_pin() -> None:
            async with run.store.experts(0, [0, 1]) as views:
                assert views[0] is not None
                kept.append(np.frombuffer(views[0].gate.data, dtype=np.uint8))

        with pytest.raises(ResourceWarning, match="still exported"):
            await keep_past_the_pin()
        assert bytes(kept[0]) == reference[(0, 0)][0]
        del kept[:]
        assert run.store.statistics().pinned_slots == 0
        assert await run.verify_all() == []  # a whole slab at a time: every slot is usable
        assert run.problems() == []
        assert await run.close_and_check() == []
    finally:
        await run.close_if_open()


@pytest.mark.parametrize("anyio_backend", ASYNCIO_LOOPS)
async def test_aclose_cancelled_at_every_step_ends_once_the_release_has_finished(
    model_path: Path, reference: dict[Key, list[bytes]], moe_refs: MoEReference, anyio_backend: object
) -> None:
    # Issue 31 item 1: a Task.cancel() at every step (a caller that cancels the task again each
    # time it wakes) was held through the release, as it should, but aclose() never returned
    # after it: the wait for the release thread was started again, and its first checkpoint took
    # the next cancellation, for ever (the task spun on the loop; closing the loop never ended).
    import asyncio

    run = await StoreRun.open(model_path, FaultyFake, reference, moe_refs, slots=4)
    cancelling = [False]
    task: list[asyncio.Task[object]] = []
    try:
        assert await run.request(0, [0, 1]) == "ok"
        run.note_slab()
        run.backend.close_delay = 0.05  # the release thread takes a while: aclose waits for it

        def at_step(k: int) -> None:
            if cancelling[0]:
                task[0].cancel()

        stepper = Stepper(run.store.aclose(), at_step)

        async def close() -> object:
            return await stepper

        task.append(asyncio.get_running_loop().create_task(close()))
        await anyio.sleep(0.01)  # aclose is waiting for the release thread
        cancelling[0] = True
        task[0].cancel()  # and again at every step from now on
        with anyio.move_on_after(BOUND):
            while not task[0].done():
                await asyncio.sleep(0.01)
        ended = task[0].done()
    finally:
        cancelling[0] = False  # let a task that spins end all the same
        with anyio.fail_after(BOUND):
            while task and not task[0].done():
                await asyncio.sleep(0.01)
        await run.close_if_open()
    assert ended, f"aclose still waiting {stepper.steps} steps after the release had finished"
    assert task[0].cancelled()
    assert run.store.closed and run.leftovers() == []
