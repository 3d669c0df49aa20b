"""Backend choice: io_uring when it works, else the thread pool with one log line saying why."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import anyio
import liburing
import pytest
from conftest import direct_io_unavailable
from ioutil import pread_segment

import aioexperts
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


async def read_all(store: aioexperts.ExpertStore) -> dict[tuple[int, int], list[bytes]]:
    out = {}
    for layer, moe in store.layout.layers.items():
        for e in range(moe.n_experts):
            async with store.experts(layer, [e]) as (view,):
                assert view is not None
                out[(layer, e)] = [bytes(p.data) for p in (view.gate, view.up, view.down)]
    return out


@pytest.mark.parametrize(
    ("err", "needle"),
    [(errno.EPERM, "EPERM"), (errno.ENOSYS, "ENOSYS")],
    ids=["EPERM", "ENOSYS"],
)
async def test_io_uring_setup_failure_falls_back_to_threads(
    small_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    err: int,
    needle: str,
    anyio_backend: object,
) -> None:
    def refuse(entries: int, ring: object, *args: object) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(liburing, "io_uring_queue_init", refuse)
    caplog.set_level(logging.WARNING, logger="aioexperts")
    async with aioexperts.open(small_model, slots=4, io=aioexperts.IOOptions(backend="auto")) as store:
        st = store.statistics()
        assert st.backend == "threads"
        assert st.fallback_reason is not None and needle in st.fallback_reason
        got = await read_all(store)
    lines = [r for r in caplog.records if r.name == "aioexperts" and "io_uring" in r.getMessage()]
    assert len(lines) == 1  # one line for the backend (another may say direct I/O is off, e.g. on tmpfs)
    assert needle in lines[0].getMessage() and "thread" in lines[0].getMessage()
    model = aioexperts.open_model(small_model)
    layout = aioexperts.build_layout(model)
    for (layer, e), data in got.items():
        assert data == [pread_segment(model, s) for s in layout.locate(layer, e).segments]


async def test_forced_io_uring_that_cannot_start_is_an_error(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    def refuse(entries: int, ring: object, *args: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(liburing, "io_uring_queue_init", refuse)
    with pytest.raises(aioexperts.BackendUnavailableError, match="EPERM"):
        async with aioexperts.open(small_model, io=aioexperts.IOOptions(backend="io_uring")):
            pass


async def test_auto_picks_io_uring_with_direct_io_here(small_model: Path, anyio_backend: object) -> None:
    reason = await anyio.to_thread.run_sync(direct_io_unavailable, small_model.parent)  # probes: off the loop
    if reason is not None:
        pytest.skip(reason)
    async with aioexperts.open(small_model, slots=4) as store:
        st = store.statistics()
        assert (st.backend, st.direct_io, st.fallback_reason, st.buffered_reason) == (
            "io_uring",
            True,
            None,
            None,
        )


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
async def test_tmpfs_gets_buffered_reads_and_says_why(small_model: Path, anyio_backend: object) -> None:
    path = Path("/dev/shm") / f"aioexperts-{os.getpid()}-{id(small_model)}.gguf"
    path.write_bytes(small_model.read_bytes())
    try:
        async with aioexperts.open(path, slots=4) as store:
            st = store.statistics()
            assert not st.direct_io
            assert st.buffered_reason is not None and "tmpfs" in st.buffered_reason
            got = await read_all(store)
        model = aioexperts.open_model(path)
        layout = aioexperts.build_layout(model)
        for (layer, e), data in got.items():
            assert data == [pread_segment(model, s) for s in layout.locate(layer, e).segments]
        with pytest.raises(aioexperts.BackendUnavailableError, match="direct I/O"):
            async with aioexperts.open(path, io=aioexperts.IOOptions(direct_io=True)):
                pass
    finally:
        path.unlink()


async def test_unknown_backend_name_is_a_config_error(small_model: Path, anyio_backend: object) -> None:
    with pytest.raises(aioexperts.ConfigError, match="backend must be one of"):
        async with aioexperts.open(small_model, io=aioexperts.IOOptions(backend="spdk")):
            pass


async def test_buffered_reads_on_request(small_model: Path, anyio_backend: object) -> None:
    async with aioexperts.open(small_model, slots=4, io=aioexperts.IOOptions(direct_io=False)) as store:
        st = store.statistics()
        assert not st.direct_io and "direct_io=False" in (st.buffered_reason or "")
        assert len(await read_all(store)) == 16


LOG_CALLS = ("debug", "info", "warning", "error", "exception", "critical", "log", "_log_once")


def _called_name(node: object) -> str | None:
    import ast

    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return node.func.id if isinstance(node.func, ast.Name) else None


def _starts_with_prefix(node: object) -> bool:
    """The message (first argument, or the one after a level: ``log.log``, ``_log_once``) starts "aioexperts"."""
    import ast

    assert isinstance(node, ast.Call)
    return any(
        isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.lower().startswith("aioexperts")
        for arg in node.args[:3]
    )


def test_log_messages_carry_no_duplicated_prefix() -> None:
    """The logger is named ``aioexperts``; a message starting with "aioexperts:" prints it twice."""
    import ast

    root = Path(aioexperts.__file__).parent
    offenders = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if _called_name(node) in LOG_CALLS and _starts_with_prefix(node)
    ]
    assert offenders == []
