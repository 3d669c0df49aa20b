"""A hypothesis state machine over the public store, on the fake backend, with the fault knobs.

The machine opens a real store (``aioexperts.open`` with the slot-guarded scripted fake in manual
mode) on an event loop running in a thread of its own (an anyio blocking portal: asyncio, uvloop
or trio), and interleaves at random:

- requests (``store.experts()``, waiting for slots or not), each in a task that holds its views
  until it is released; releases; cancellations (a cancel scope, or ``Task.cancel()`` on asyncio);
- completions of any pending read: full, short (1 byte, half, a multiple of the kernel's direct-I/O
  alignment), zero, ``EIO``, ``EINTR``; every pending read at once;
- submit failures (a ``SubmitError`` after taking part of the batch, or a bare exception outside the
  contract); prefetches and drops of queued prefetches; a policy hook that raises; close.

After every step it checks (:meth:`StoreMachine.check`): no slot read into while another load owns
it (the slot guard); nothing submitted once ``aclose()`` began; the store's reads in flight equal
the backend's; pinned slots between the experts held and the experts of every request still
running; a request that does not wait waits only for its own loads or for loads nobody pinned when
it came; no request is left waiting when no read is pending and nobody holds anything (a lost
wake-up); a short read that ends on the direct-I/O alignment continues right after the bytes
received; views with the right bytes, still right when released; errors only where a fault was
injected; an ``aclose()`` that ended, by returning or by raising a cancellation, released the
backend. :meth:`StoreMachine.check_the_cache` looks inside (white-box): every slot free or held by
exactly one entry, and only requests that wait for slots queue for them. At the end every request
must finish once everything is released and completed, before anything is cancelled; then every
expert's bytes are checked again (a whole slab at a time) and, after close, descriptors, io_uring
mappings and the slab's mapping are back to where they were.

Each of issue 7's fixes that this level can reach (1, 2, 3, 5, 6, 7) makes the machine fail when
it is reverted; docs/architecture.md lists which check catches which.
"""

from __future__ import annotations

import errno
import os
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import aioexperts
from aioexperts._cache.cache import SlotState
from aioexperts._io.backends.base import ReadOp
from faults.policy import HOOKS, OnceFaulty
from faults.script import FaultyFake
from faults.stack import BOUND, Key
from faults.storekit import StoreRun

N_SLOTS = 4
N_LAYERS, N_EXPERTS = 3, 8  # the SMALL model of conftest.py
MAX_REQUESTS = 10  # running at once
#: Reads in flight at most: fewer than a whole-slab request needs (4 experts x 3 reads), so loads
#: and re-reads queue in the scheduler behind the reads in flight (and may meet close there).
DEPTH = 6
LOOPS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}
COMPLETIONS = ("full", "full", "short1", "half", "aligned", "aligned", "zero", "eio", "eintr")
LAYER = st.integers(0, N_LAYERS - 1)
IDS = st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=3, unique=True)


class Request:
    """One ``experts()`` call in a task of the portal's loop.

    Attributes:
        stage: ``"start"``, ``"acquire"`` (inside ``experts()``, not served yet), ``"holding"``
            (views served, waiting for :attr:`release`), ``"done"``.
        outcome: ``"ok"``, ``"cancelled"``, the ``AioExpertsError`` class name, ``"WRONG BYTES"``
            or ``"UNEXPECTED ..."``.
    """

    def __init__(self, n: int, layer: int, ids: list[int], wait: bool) -> None:
        self.n, self.layer, self.ids, self.wait = n, layer, ids, wait
        self.keys = {(layer, e) for e in ids}
        #: experts loading and pinned by nobody when the request started: one that does not wait
        #: may wait for those (their slots become evictable), and for its own loads, nothing else
        self.may_wait_for: set[Key] = set()
        self.stage = "start"
        self.outcome: str | None = None
        self.release: anyio.Event | None = None
        self.released = False
        self.scope: anyio.CancelScope | None = None
        self.task: Any = None

    def __repr__(self) -> str:
        return f"<request {self.n} layer {self.layer} {self.ids} wait={self.wait} {self.stage} {self.outcome}>"


class StoreMachine(RuleBasedStateMachine):
    """See the module docstring. ``LOOP``, ``PATH`` and ``REFERENCE`` are set per test."""

    LOOP: tuple[str, dict[str, Any]] = LOOPS["asyncio"]
    PATH: Path
    REFERENCE: dict[Key, list[bytes]]

    def __init__(self) -> None:
        super().__init__()
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] = (
            anyio.from_thread.start_blocking_portal(*self.LOOP)
        )
        self.portal = self._portal_cm.__enter__()
        self.requests: list[Request] = []
        self.may_fail: set[Key] = set()  # keys whose load met a fault that legitimately fails it
        self.expected_retry: tuple[int, int, int, int, int] | None = None
        self.close_started = False
        self.close_done = False
        self.close_outcome: str | None = None
        self.close_scope: anyio.CancelScope | None = None
        self.close_task: Any = None
        self.submits_at_close: int | None = None
        self.policy = OnceFaulty()
        try:
            self.run: StoreRun = self.portal.call(self._open)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self.fake: FaultyFake = self.run.backend
        # the backend's release (in aclose()'s release thread) waits for this gate: a cancellation
        # can then arrive while the release runs (rule finish_the_release opens it)
        self.release_gate = threading.Event()
        release = self.fake.close

        def gated_close() -> None:
            self.release_gate.wait(BOUND)
            release()

        self.fake.close = gated_close  # type: ignore[method-assign]
        self.fake.after_submit = self._after_submit
        self.align = self.fake.files.dio_alignment if self.fake.direct_io else 1

    async def _open(self) -> StoreRun:
        return await StoreRun.open(
            self.PATH, FaultyFake, self.REFERENCE, {}, slots=N_SLOTS, depth=DEPTH, policy=self.policy, auto=False
        )

    # -- helpers (loop thread unless said) ------------------------------------------------------------

    def _after_submit(self, ops: Any, taken: int) -> None:
        if taken < len(ops):  # every load with a read in this batch fails (partly taken ones too)
            self.may_fail.update(key_of(op) for op in ops)

    async def _settle(self) -> None:
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        await anyio.wait_all_tasks_blocked()
        for _ in range(3):
            await anyio.lowlevel.checkpoint()

    def settle(self) -> None:
        """Let the loop run until every task waits (thread)."""
        self.portal.call(self._settle)

    async def _run_request(self, req: Request) -> None:
        req.release = anyio.Event()
        req.scope = scope = anyio.CancelScope()
        if self.LOOP[0] == "asyncio":
            import asyncio

            req.task = asyncio.current_task()
        try:
            with scope:
                req.stage = "acquire"
                try:
                    async with self.run.store.experts(req.layer, req.ids, wait=req.wait) as views:
                        req.stage = "holding"
                        right = self.run.views_right(req.layer, req.ids, views)
                        await req.release.wait()
                        right = right and self.run.views_right(req.layer, req.ids, views)  # still pinned: same bytes
                    req.outcome = "ok" if right else "WRONG BYTES"
                except aioexperts.AioExpertsError as exc:
                    req.outcome = type(exc).__name__
                except Exception as exc:
                    req.outcome = f"UNEXPECTED {exc!r}"
            if scope.cancelled_caught:
                req.outcome = "cancelled"
        except BaseException as exc:  # asyncio's Task.cancel(): the task ends here
            if type(exc).__name__ != "CancelledError":
                raise
            req.outcome = "cancelled"
        finally:
            req.stage = "done"

    def _unpinned_loads(self) -> set[Key]:
        cache = self.run.store._source.cache  # white-box: the cache's entries, read only
        assert cache is not None
        return {key for key, e in cache.entries.items() if e.state is SlotState.LOADING and not e.pins}

    async def _close(self) -> None:
        self.close_scope = scope = anyio.CancelScope()
        if self.LOOP[0] == "asyncio":
            import asyncio

            self.close_task = asyncio.current_task()
        self.submits_at_close = self.fake.submit_calls  # aclose() closes the scheduler before it awaits
        try:
            with scope:
                await self.run.store.aclose()
            self.close_outcome = "ok"  # a cancel scope: aclose() shields its waits and finishes
        except BaseException as exc:  # Task.cancel(): held until everything is released, then raised
            self.close_outcome = type(exc).__name__
            if not isinstance(exc, Exception) and self.close_outcome != "CancelledError":
                raise
        finally:
            self.close_done = True

    def running(self) -> list[Request]:
        return [r for r in self.requests if r.stage != "done"]

    # -- rules ----------------------------------------------------------------------------------------

    # Rules are drawn uniformly; the frequent kinds of step are two rules each (request, complete,
    # release), and close needs some requests first: most of an example runs with the store open.

    @precondition(lambda self: len(self.running()) < MAX_REQUESTS)
    @rule(layer=LAYER, ids=IDS, wait=st.booleans())
    def request(self, layer: int, ids: list[int], wait: bool) -> None:
        self._request(layer, ids, wait)

    @precondition(lambda self: len(self.running()) < MAX_REQUESTS)
    @rule(layer=LAYER, ids=IDS, wait=st.booleans())
    def another_request(self, layer: int, ids: list[int], wait: bool) -> None:
        self._request(layer, ids, wait)

    @precondition(lambda self: len(self.running()) < MAX_REQUESTS)
    @rule(layer=LAYER, first=st.integers(0, N_EXPERTS - N_SLOTS), wait=st.booleans())
    def request_a_whole_slab(self, layer: int, first: int, wait: bool) -> None:
        """A request for as many experts as there are slots (a prefill batch): it waits for every slot."""
        self._request(layer, list(range(first, first + N_SLOTS)), wait)

    def _request(self, layer: int, ids: list[int], wait: bool) -> Request:
        req = Request(len(self.requests), layer, ids, wait)
        if not wait:
            req.may_wait_for = self.portal.call(self._unpinned_loads)
        self.requests.append(req)
        self.portal.start_task_soon(self._run_request, req)
        self.settle()
        return req

    @initialize(layer=LAYER, ids=st.lists(st.integers(0, N_EXPERTS - 1), max_size=3, unique=True))
    def start_with_a_holder(self, layer: int, ids: list[int]) -> None:
        """Most examples start with experts held (pinned) by a request: slots are short from the start."""
        if ids:
            self.request_served_at_once(layer, ids)

    @precondition(lambda self: len(self.running()) < MAX_REQUESTS)
    @rule(layer=LAYER, ids=IDS)
    def request_served_at_once(self, layer: int, ids: list[int]) -> None:
        """A request whose reads all complete right away: it then holds its experts (pins slots)."""
        req = self._request(layer, ids, True)

        def complete_its_reads() -> bool:
            ops = [op for op in self.fake.pending if key_of(op) in req.keys]
            for op in ops:
                self.fake.complete(op)
            return bool(ops)

        while self.portal.call(complete_its_reads):  # its queued reads go out as the first complete
            self.settle()

    @precondition(lambda self: self.running())
    @rule(i=st.integers(0, 1 << 16))
    def release(self, i: int) -> None:
        self._release(i)

    @precondition(lambda self: self.running())
    @rule(i=st.integers(0, 1 << 16))
    def release_another(self, i: int) -> None:
        self._release(i)

    def _release(self, i: int) -> None:
        req = self.running()[i % len(self.running())]
        req.released = True
        if req.release is not None:
            self.portal.call(req.release.set)
        self.settle()

    @precondition(lambda self: self.running())
    @rule(i=st.integers(0, 1 << 16), native=st.booleans())
    def cancel(self, i: int, native: bool) -> None:
        req = self.running()[i % len(self.running())]
        if native and req.task is not None:
            self.portal.call(req.task.cancel)
        elif req.scope is not None:
            self.portal.call(req.scope.cancel)
        self.settle()

    @precondition(lambda self: self.fake.pending)
    @rule(i=st.integers(0, 1 << 16), how=st.sampled_from(COMPLETIONS), k=st.integers(1, 16))
    def complete(self, i: int, how: str, k: int) -> None:
        self._complete(i, how, k)

    @precondition(lambda self: self.fake.pending)
    @rule(i=st.integers(0, 1 << 16), how=st.sampled_from(COMPLETIONS), k=st.integers(1, 16))
    def complete_another(self, i: int, how: str, k: int) -> None:
        self._complete(i, how, k)

    def _complete(self, i: int, how: str, k: int) -> None:
        op = self.fake.pending[i % len(self.fake.pending)]
        result: int | Exception | None = None
        if how == "short1":
            result = 1
        elif how == "half":
            result = op.n_bytes // 2
        elif how == "aligned":  # bytes up to a multiple of the direct-I/O alignment: the re-read starts there
            result = min(k * self.align, (op.n_bytes - 1) // self.align * self.align) or None  # (else: full)
        elif how == "zero":
            result = 0
        elif how == "eio":
            result = OSError(errno.EIO, "Input/output error")
        elif how == "eintr":
            result = OSError(errno.EINTR, "Interrupted system call")
        if how in ("short1", "half", "zero", "eio", "eintr"):
            # zero and EIO fail the load; a short read that makes no aligned progress and EINTR are
            # re-read, and fail the load once they stall too often in a row
            self.may_fail.add(key_of(op))
        self.expected_retry = None
        if how == "aligned" and isinstance(result, int) and result > 0:
            r = result
            self.expected_retry = (op.shard, op.file_offset + r, op.n_bytes - r, op.slot, op.slot_offset + r)
        self.portal.call(self.fake.complete, op, result)
        self.settle()
        expected, self.expected_retry = self.expected_retry, None
        if expected is not None and not self.run.store.closed and self.fake.submit_fault is None:
            scheduler = self.run.store._source.scheduler  # white-box: a re-read may still be queued there
            assert scheduler is not None
            queued = [*self.fake.pending, *scheduler._retries]
            pending = [(o.shard, o.file_offset, o.n_bytes, o.slot, o.slot_offset) for o in queued]
            assert expected in pending, (
                f"a short read of {r} bytes ({self.align}-byte direct-I/O alignment) did not continue right "
                f"after them: expected {expected}, pending {pending}"
            )

    @precondition(lambda self: self.fake.pending)
    @rule()
    def complete_all(self) -> None:
        self.portal.call(self.fake.complete_all)
        self.settle()

    @rule(at=st.sampled_from(["first", "middle", "last", 1]), raw=st.booleans())
    def fail_next_submit(self, at: str | int, raw: bool) -> None:
        exc = RuntimeError("scripted submit failure") if raw else OSError(errno.EFAULT, "Bad address")
        self.fake.submit_fault = (self.fake.submit_calls, at, exc)
        self.fake.raw_submit = raw
        self.settle()

    @rule(layer=st.integers(0, N_LAYERS - 1), ids=st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=4))
    def prefetch(self, layer: int, ids: list[int]) -> None:
        def prefetch() -> None:
            try:
                self.run.store.prefetch([(layer, e) for e in ids])
            except (aioexperts.EvictionPolicyError, aioexperts.StoreClosedError):
                pass

        self.portal.call(prefetch)
        self.settle()

    @rule(layer=st.integers(0, N_LAYERS - 1))
    def drop(self, layer: int) -> None:
        def drop() -> None:
            try:
                self.run.store.drop_prefetches(keep=lambda key: key[0] != layer)
            except aioexperts.StoreClosedError:
                pass

        self.portal.call(drop)
        self.settle()

    @rule(hook=st.sampled_from(HOOKS))
    def policy_raises(self, hook: str) -> None:
        self.policy.arm(hook)
        self.settle()

    @precondition(lambda self: not self.close_started and len(self.requests) >= 6)
    @rule()
    def close(self) -> None:
        self.close_started = True
        self.portal.start_task_soon(self._close)
        self.settle()

    @precondition(lambda self: not self.close_started and len(self.requests) >= 6 and self.fake.pending)
    @rule(i=st.integers(0, 1 << 16), how=st.sampled_from(["half", "aligned", "eintr"]))
    def a_read_needs_a_re_read_as_close_begins(self, i: int, how: str) -> None:
        """A completion that queues a re-read, then ``aclose()`` in the same tick (before the re-read goes out)."""
        op = self.fake.pending[i % len(self.fake.pending)]
        result: int | Exception
        if how == "half":
            result = op.n_bytes // 2
        elif how == "aligned":
            result = (op.n_bytes - 1) // self.align * self.align or op.n_bytes // 2
        else:
            result = OSError(errno.EINTR, "Interrupted system call")
        self.may_fail.add(key_of(op))
        self.close_started = True

        async def complete_then_close() -> None:
            self.fake.complete(op, result)  # the re-read is queued; its submission waits for the next tick
            await self._close()  # aclose() closes the scheduler before its first await

        self.portal.start_task_soon(complete_then_close)
        self.settle()

    @precondition(lambda self: self.close_started)
    @rule()
    def finish_the_release(self) -> None:
        self.release_gate.set()
        self.settle()

    # not "and not done": when aclose() returns depends on its release thread, and a precondition
    # must depend only on the steps drawn so far (hypothesis replays them)
    @precondition(lambda self: self.close_started)
    @rule(native=st.booleans())
    def cancel_close(self, native: bool) -> None:
        if self.close_done:
            return
        if native and self.close_task is not None:
            self.portal.call(self.close_task.cancel)
        elif self.close_scope is not None:
            self.portal.call(self.close_scope.cancel)
        self.settle()

    # -- invariants -----------------------------------------------------------------------------------

    @invariant()
    def check(self) -> None:
        fake = self.fake
        assert fake.violations == []
        st_ = self.run.store.statistics()
        assert st_.in_flight == fake.in_flight == len(fake.pending), (st_.in_flight, fake.in_flight, fake.pending)
        held = set().union(*(r.keys for r in self.requests if r.stage == "holding"))
        active = set().union(*(r.keys for r in self.requests if r.stage in ("acquire", "holding")))
        assert len(held) <= st_.pinned_slots <= len(active), (st_.pinned_slots, held, active)
        cache = self.run.store._source.cache  # white-box: loads submitted or still queued in the scheduler
        assert cache is not None
        pending = {key for key, e in cache.entries.items() if e.state is SlotState.LOADING}
        stuck = [
            r for r in self.requests if r.stage == "acquire" and not r.wait and not pending & (r.keys | r.may_wait_for)
        ]
        assert not stuck, f"requests that do not wait are waiting, but not for a load they may wait for: {stuck}"
        if not pending:
            waiting = [r for r in self.requests if r.stage == "acquire"]
            if not any(r.stage == "holding" for r in self.requests):
                assert not waiting, f"nothing is pinned or pending, yet requests wait (a lost wake-up): {waiting}"
        for r in self.requests:
            self.check_outcome(r)
        if self.submits_at_close is not None:
            assert fake.submit_calls == self.submits_at_close, "a read was submitted after close"
        if self.close_done:  # returned, or raised a cancellation: released either way
            assert self.close_outcome in ("ok", "CancelledError"), self.close_outcome
            assert fake.closed, f"aclose() ended ({self.close_outcome}) but the backend is not closed"

    @invariant()
    def check_the_cache(self) -> None:
        """White-box: every slot free or held by exactly one entry; only requests that wait queue for slots."""
        cache = self.run.store._source.cache
        assert cache is not None
        slots = sorted([*cache.free_slots, *(e.slot for e in cache.entries.values())])
        assert slots == list(range(N_SLOTS)), f"slots lost or doubled: {slots}"
        waiting = sum(1 for r in self.requests if r.stage == "acquire" and r.wait)
        assert len(cache._turns) <= waiting, f"{len(cache._turns)} requests queue for slots, {waiting} may wait"

    def check_outcome(self, r: Request) -> None:
        o = r.outcome
        if o is None or o in ("ok", "cancelled"):
            return
        assert o != "WRONG BYTES" and not o.startswith("UNEXPECTED"), r
        if o == "ExpertReadError":
            assert r.keys & self.may_fail, f"{r} failed but none of its experts met a fault"
        elif o == "SlabExhaustedError":
            assert not r.wait, f"{r} waits for slots, holds none and asks for at most the {N_SLOTS} slots"
        elif o == "EvictionPolicyError":
            assert self.policy.raised, r
        elif o == "StoreClosedError":
            assert self.close_started, r
        else:
            raise AssertionError(f"unexpected outcome {r}")

    # -- the end --------------------------------------------------------------------------------------

    async def _wind_down(self) -> None:
        """Release everything and complete every read; every request must then finish by itself."""
        self.policy.armed = False
        self.fake.submit_fault = None
        self.release_gate.set()
        for r in self.requests:
            if r.release is not None:
                r.release.set()
        with anyio.move_on_after(BOUND):
            while True:
                await self._settle()
                if self.fake.pending:
                    self.fake.complete_all()
                elif self.close_started and not self.close_done:
                    await anyio.sleep(0.001)  # aclose() waits for its release thread
                else:
                    break  # nothing pending, every task waits: what still runs never finishes
        # asserted before anything is cancelled: a cancellation would end a request that hangs
        assert not self.running(), f"requests never finished although everything was released: {self.running()}"
        assert not self.fake.pending
        assert not self.close_started or self.close_done, "aclose() never returned"

    async def _verify(self) -> list[str]:
        """Every expert's bytes, a whole slab at a time (unless closed); what is wrong."""
        run = self.run
        problems = run.problems()
        if not self.close_started:
            self.fake.auto = True
            problems += await run.verify_all()
            await run.quiesce()
            problems += run.problems()
            run.note_slab()
        return problems

    def _start_close(self) -> None:
        """Start ``aclose()`` in a task, unless the close rule did (test thread)."""
        self.release_gate.set()
        if not self.close_started:
            self.close_started = True
            self.portal.start_task_soon(self._close)

    async def _await_close(self) -> str | None:
        """Wait (bounded) for ``aclose()``; why it did not return, or None.

        A store whose count of reads in flight went wrong never finishes ``aclose()`` (it waits,
        shielded, for those reads): then every pending read is completed and the count is reset by
        hand, only so that the loop can stop after the failure is reported.
        """
        scheduler = self.run.store._source.scheduler  # white-box: only to tell and to rescue
        assert scheduler is not None
        with anyio.move_on_after(BOUND):
            while not self.close_done:
                if self.fake.pending:
                    self.fake.complete_all()
                elif scheduler.reads_in_flight != self.fake.in_flight:
                    break  # the store waits for reads the backend does not have: it never finishes
                await anyio.sleep(0.001)
        if self.close_done:
            return None
        with anyio.move_on_after(BOUND):
            while self.fake.pending:
                self.fake.complete_all()
                await anyio.sleep(0.001)
        scheduler._ops_in_flight = scheduler._bytes_in_flight = 0
        scheduler._retries.clear()
        scheduler._notify_quiet()
        with anyio.move_on_after(BOUND):
            while not self.close_done:
                await anyio.sleep(0.001)
        return "aclose() never returned: it waits for reads in flight that the backend does not have"

    async def _end_requests(self) -> None:
        """Cancel the requests that still run and complete every read (bounded)."""
        for r in self.requests:
            if r.task is not None and r.stage != "done":
                r.task.cancel()
            elif r.scope is not None:
                r.scope.cancel()
        self.fake.auto = True
        with anyio.move_on_after(BOUND):
            while self.fake.pending or self.running():
                self.fake.complete_all()
                await anyio.sleep(0.001)

    def teardown(self) -> None:
        closed_ok = False
        try:
            self.portal.call(self._wind_down)
            self.check()
            assert self.portal.call(self._verify) == []
            self._start_close()
            assert self.portal.call(self._await_close) is None
            closed_ok = True
            assert self.run.leftovers() == []
        finally:
            try:
                if not closed_ok:
                    self.portal.call(self._end_requests)
                    self._start_close()
                    self.portal.call(self._await_close)
            finally:
                # an exception makes the portal cancel the tasks that still run instead of waiting for them
                self._portal_cm.__exit__(_TornDown, _TornDown(), None)


class _TornDown(Exception):
    """Thrown into the portal's context manager at teardown."""


def key_of(op: ReadOp) -> Key:
    """The expert a read belongs to (the scheduler's load is the op's context)."""
    loc = op.context[0].plan.location
    return (loc.layer, loc.expert)


@pytest.fixture(params=list(LOOPS))
def machine(request: pytest.FixtureRequest, model_path: Path, reference: dict[Key, list[bytes]]) -> type[StoreMachine]:
    cls = type(f"StoreMachine_{request.param}", (StoreMachine,), {"LOOP": LOOPS[request.param]})
    cls.PATH, cls.REFERENCE = model_path, reference
    return cls


#: Examples per event loop; the asyncio loop gets more (its Task.cancel() is a knob of its own).
EXAMPLES = {"asyncio": 60, "uvloop": 30, "trio": 30}
if os.environ.get("AIOEXPERTS_LONG_MACHINE"):  # a long hunt: AIOEXPERTS_LONG_MACHINE=N examples per loop
    EXAMPLES = dict.fromkeys(EXAMPLES, int(os.environ["AIOEXPERTS_LONG_MACHINE"]))


def test_random_interleavings_on_the_public_store(machine: type[StoreMachine]) -> None:
    loop = machine.__name__.removeprefix("StoreMachine_")
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES[loop],
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
