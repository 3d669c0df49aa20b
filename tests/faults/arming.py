"""Arming one case of the fault matrix on a backend: the scripted fake, or io_uring under the ring proxy.

Shared by the core matrix (``test_matrix.py``) and the store matrix (``test_store_matrix.py``):
the case names are the same, and so is what each one breaks.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from faults.policy import OnceFaulty
from faults.ringproxy import RingFaults
from faults.script import POSITIONS, FaultyFake, ReadFault, position


@dataclass(frozen=True)
class Case:
    """One fault. ``backends`` it applies to; ``positioned``: run at first, middle and last read."""

    name: str
    backends: tuple[str, ...] = ("fake", "uring")
    positioned: bool = True
    closes: bool = False


CORE_CASES = [
    Case("submit raises OSError"),  # fake: takes the reads before the position; uring: takes none
    Case("submit raises RuntimeError"),
    Case("submit EAGAIN, then the retry raises", ("uring",), positioned=False),
    Case("prep raises", ("uring",)),
    Case("submission queue full", ("uring",)),
    *(Case(f"completion {kind}") for kind in ("eio", "eintr", "ecanceled")),
    *(Case(f"completion {kind}") for kind in ("short1", "half", "all_but_one", "zero")),
    *(Case(f"completion {kind}") for kind in ("short1_repeatedly", "half_repeatedly", "all_but_one_repeatedly")),
    Case("completion eintr_repeatedly"),
    Case("completions out of order", positioned=False),
    Case("duplicate completion", ("uring",)),
    Case("registration ENOMEM", ("uring",), positioned=False),
    Case("no probe", ("uring",), positioned=False),
    *(Case(f"policy {hook} raises", positioned=False) for hook in ("victim", "remove", "access", "admit")),
    Case("close during in-flight reads", positioned=False, closes=True),
    Case("close during a retry", closes=True),
    Case("close during a failed submit", closes=True),
]


def params(cases: Sequence[Case]) -> Iterator[Any]:
    """pytest params ``(case, backend, at)`` of every case, backend and position."""
    for case in cases:
        for backend in case.backends:
            for at in POSITIONS if case.positioned else ("-",):
                yield pytest.param(case, backend, at, id=f"{backend}-{case.name.replace(' ', '_')}-{at}")


@dataclass
class ArmedFault:
    """What arming did.

    Attributes:
        fired: True once the fault took effect (a case whose fault never fires proves nothing).
        read_fault: the completion fault, for cases that script one.
        expect_unexpected: io_uring will see completions it did not ask for (duplicates).
    """

    fired: Callable[[], bool] = field(default=lambda: True)
    read_fault: ReadFault | None = None
    expect_unexpected: bool = False


def arm_fault(
    name: str, at: str, fake: FaultyFake | None, ring: RingFaults, policy: OnceFaulty, first_batch: int
) -> ArmedFault:
    """Arm case ``name`` at ``at`` (``"first"``, ``"middle"``, ``"last"`` of ``first_batch`` reads, or ``"-"``).

    ``fake`` is the scripted backend, or None for io_uring under ``ring``.
    """
    armed = ArmedFault()
    pos = position(at, first_batch) if at != "-" else 0
    if name.startswith("submit raises") or name == "close during a failed submit":
        exc: Exception = RuntimeError("scripted submit failure")
        if name == "submit raises OSError":
            exc = OSError(errno.EFAULT, "Bad address")
        if fake is not None:
            calls = fake.submit_calls
            fake.submit_fault = (calls, at if at != "-" else "first", exc)
            fake.raw_submit = name == "submit raises outside the contract"
            armed.fired = lambda: fake.submit_calls > calls
        elif name == "close during a failed submit":
            n = ring.calls["prep"] + pos
            ring.fail_prep(n, exc)
            armed.fired = lambda: ring.calls["prep"] > n
        else:
            n = ring.calls["submit"]
            ring.fail_submit(n, exc)
            armed.fired = lambda: ring.calls["submit"] > n
    elif name == "submit EAGAIN, then the retry raises":
        n = ring.calls["submit"]
        ring.fail_submit(n, OSError(errno.EAGAIN, "Resource temporarily unavailable"))
        ring.fail_submit(n + 1, RuntimeError("the retry failed"))
        armed.fired = lambda: ring.calls["submit"] > n + 1
    elif name == "prep raises":
        n = ring.calls["prep"] + pos
        ring.fail_prep(n)
        armed.fired = lambda: ring.calls["prep"] > n
    elif name == "submission queue full":
        n = ring.calls["get_sqe"] + pos
        ring.sqe_none(n)
        ring.sqe_none(n + 1)
        armed.fired = lambda: ring.calls["get_sqe"] > n + 1
    elif name.startswith("completion ") or name == "close during a retry":
        kind = name.split()[1] if name.startswith("completion ") else "half"
        armed.read_fault = fault = ReadFault(kind, at=at)  # batch 0: the first submit from now on
        if fake is not None:
            fake.read_fault = fault
        else:
            ring.rewrite = ring.read_fault(fault)
        armed.fired = lambda: fault.hits > 0
    elif name == "completions out of order" and fake is None:
        ring.rewrite = RingFaults.reverse
    elif name == "duplicate completion":
        ring.rewrite = RingFaults.duplicate(lambda walk: walk[position(at, len(walk))][0])
        armed.expect_unexpected = True
    elif name.startswith("policy"):
        policy.armed = True
        armed.fired = lambda: policy.raised == 1
    return armed
