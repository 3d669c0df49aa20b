"""The liburing wheel is probed in a child process: a SIGILL there means io_uring is refused, never a crash."""

from __future__ import annotations

import errno
import logging
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

import aioexperts
import aioexperts._io.select as select_module
from aioexperts._io import uring_probe, uring_raw
from aioexperts.testing import SyntheticSpec, write_synthetic_model

SMALL = SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2)


def _child_ends(monkeypatch: pytest.MonkeyPatch, returncode: int) -> list[list[str]]:
    calls: list[list[str]] = []

    def run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
        calls.append(args)
        return subprocess.CompletedProcess(args, returncode, b"", b"")

    monkeypatch.setattr(uring_probe.subprocess, "run", run)
    return calls


def test_a_child_killed_by_sigill_names_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _child_ends(monkeypatch, -signal.SIGILL)
    reason = uring_probe.liburing_unusable_reason.__wrapped__()
    assert reason is not None and "SIGILL" in reason and "CPU" in reason
    assert len(calls) == 1 and "lu.Ring()" in calls[0][-1]


def test_other_signals_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _child_ends(monkeypatch, -signal.SIGSEGV)
    reason = uring_probe.liburing_unusable_reason.__wrapped__()
    assert reason is not None and "SIGSEGV" in reason


@pytest.mark.parametrize("returncode", [0, 1], ids=["ring works", "python exception (EPERM): raised safely in-process"])
def test_a_child_that_exits_counts_as_usable(monkeypatch: pytest.MonkeyPatch, returncode: int) -> None:
    _child_ends(monkeypatch, returncode)
    assert uring_probe.liburing_unusable_reason.__wrapped__() is None


def test_the_real_probe_agrees_with_a_real_child() -> None:
    proc = subprocess.run(
        [uring_probe.sys.executable, "-c", uring_probe._PROBE], capture_output=True, timeout=60, check=False
    )
    reason = uring_probe.liburing_unusable_reason()
    assert (reason is None) == (proc.returncode >= 0)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


def _refuse_raw_rings(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: object, entries: int, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "io_uring_setup: Operation not permitted")

    monkeypatch.setattr(uring_raw.RawRing, "__init__", refuse)


@pytest.mark.anyio
async def test_without_the_wheel_auto_runs_io_uring_on_the_raw_ring_and_says_why(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    monkeypatch.setattr(select_module, "liburing_unusable_reason", lambda: "the liburing wheel stops with SIGILL")
    for backend in ("auto", "io_uring"):
        async with aioexperts.open(small_model, slots=4, io=aioexperts.IOOptions(backend=backend)) as store:
            st = store.statistics()
            assert (st.backend, st.fallback_reason) == ("io_uring", None)
            assert st.backend_features["ring"] == "raw system calls"
            assert "SIGILL" in st.backend_features["ring_reason"]
            async with store.experts(0, [1]) as (view,):
                assert len(view.gate.data) > 0


@pytest.mark.anyio
async def test_auto_falls_back_to_threads_with_the_reason(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, anyio_backend: object
) -> None:
    monkeypatch.setattr(select_module, "liburing_unusable_reason", lambda: "the liburing wheel stops with SIGILL")
    _refuse_raw_rings(monkeypatch)
    caplog.set_level(logging.WARNING, logger="aioexperts")
    async with aioexperts.open(small_model, slots=4, io=aioexperts.IOOptions(backend="auto")) as store:
        st = store.statistics()
        assert st.backend == "threads"
        assert st.fallback_reason is not None and "SIGILL" in st.fallback_reason and "EPERM" in st.fallback_reason
        async with store.experts(0, [1]) as (view,):
            assert len(view.gate.data) > 0
    assert any("SIGILL" in r.getMessage() and "thread" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
async def test_a_forced_backend_the_wheel_cannot_run_is_refused_not_crashed(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    monkeypatch.setattr(select_module, "liburing_unusable_reason", lambda: "the liburing wheel stops with SIGILL")
    _refuse_raw_rings(monkeypatch)
    for backend in ("io_uring", "io_uring_raw"):
        with pytest.raises(aioexperts.BackendUnavailableError, match="EPERM"):
            async with aioexperts.open(small_model, io=aioexperts.IOOptions(backend=backend)):
                pass
