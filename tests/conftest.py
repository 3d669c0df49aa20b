"""Shared test configuration: event-loop backends and the shared GGUF fixtures."""

from __future__ import annotations

import errno
import mmap
import os
import re
from pathlib import Path

import numpy as np
import pytest
from blocking import blockbuster as blockbuster  # blocking calls on the loop fail async tests: tests/blocking.py
from hang_watchdog import pytest_runtest_protocol as pytest_runtest_protocol  # a hang ends the run: exit 3
from hypothesis import Phase, settings

from aioexperts._io.uring_probe import io_uring_unusable_reason, liburing_unusable_reason

#: ``--hypothesis-profile=find-only``: generate fresh examples without replaying the example
#: database and without shrinking: does a property test or the store state machine find a bug (a
#: reverted fix) at all, from scratch? (``tests/faults/revert_check.py`` runs it per reverted fix.)
settings.register_profile("find-only", phases=[Phase.explicit, Phase.generate], database=None)

#: Every async test marked ``anyio`` runs on each of these event loops.
ANYIO_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=ANYIO_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


def shared_vocab_paths() -> list[Path]:
    """llama.cpp's vocabulary-only ``*.gguf`` files: ``$AIOEXPERTS_VOCAB``, else ``vocab`` beside the
    shared fixtures, else ``../shared/vocab`` beside the checkout; empty if none is found (an error
    with ``AIOEXPERTS_REQUIRE_FIXTURES=1``)."""
    env = os.environ.get("AIOEXPERTS_VOCAB")
    fixtures = shared_fixtures_dir()
    repo = Path(__file__).resolve().parents[1]
    candidates = [
        *([Path(env)] if env else []),
        *([fixtures.parent / "vocab"] if fixtures is not None else []),
        repo.parent / "shared" / "vocab",
    ]
    for cand in candidates:
        found = sorted(cand.glob("*.gguf")) if cand.is_dir() else []
        if found:
            return found
    if os.environ.get("AIOEXPERTS_REQUIRE_FIXTURES") == "1":
        tried = " or ".join(map(str, candidates))
        raise RuntimeError(f"the shared vocab files are required but no *.gguf is in {tried}")
    return []


def _fixture_candidates() -> list[Path]:
    env = os.environ.get("AIOEXPERTS_FIXTURES")
    repo = Path(__file__).resolve().parents[1]
    return [*([Path(env)] if env else []), repo.parent / "shared" / "fixtures"]


def shared_fixtures_dir() -> Path | None:
    """``$AIOEXPERTS_FIXTURES``, else ``../shared/fixtures`` beside the checkout."""
    for cand in _fixture_candidates():
        if cand.is_dir() and any(cand.rglob("*.gguf")):
            return cand
    return None


def shared_fixture_paths() -> list[Path]:
    """Every shared ``*.gguf`` fixture; empty if the folder is absent.

    With ``AIOEXPERTS_REQUIRE_FIXTURES=1`` (set by ``.ci/run``) a missing folder is an error, so
    CI cannot pass by skipping.
    """
    root = shared_fixtures_dir()
    if root is None:
        if os.environ.get("AIOEXPERTS_REQUIRE_FIXTURES") == "1":
            raise RuntimeError(
                "the shared fixtures are required (AIOEXPERTS_REQUIRE_FIXTURES=1) but no *.gguf is in "
                + " or ".join(map(str, _fixture_candidates()))
            )
        return []
    return sorted(root.rglob("*.gguf"))


#: Names that, in a test's code or fixtures, mean it drives the ``liburing`` wheel itself (its
#: fault-injecting proxy ``faults.ringproxy``, a monkeypatch of the module, the wrapper's backend).
_LIBURING_NAMES = frozenset(("liburing", "RingFaults", "CheckedUring", "UringBackend"))


def _io_uring_need(item: pytest.Item) -> str | None:
    """``"liburing"`` for a test of the wheel itself, ``"io_uring"`` for one that needs a working
    ring through the public API (``liburing`` or the raw-syscall ring), None for neither."""
    if item.get_closest_marker("liburing") is not None:
        return "liburing"
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "backend" in callspec.params:  # the matrices: fake and uring cases
        value = str(callspec.params["backend"]).lower()
        if value == "uring":  # the real half of the fault matrices: UringBackend under the liburing proxy
            return "liburing"
        return "io_uring" if "uring" in value else None
    function = getattr(item, "function", None)
    names = set(function.__code__.co_names) if function is not None else set()
    if "ring" in getattr(item, "fixturenames", ()) or names & _LIBURING_NAMES:  # "ring": the RingFaults fixture
        return "liburing"
    if item.get_closest_marker("io_uring") is not None or re.search(r"uring|(^|_)rings?(_|\[|$)", item.name.lower()):
        return "io_uring"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The liburing wheel dies with SIGILL on CPUs without AVX-512 (aioexperts/_io/uring_probe.py):
    # there the tests of the wheel itself are skipped with that reason; io_uring through the public
    # API runs on the raw-syscall ring (aioexperts/_io/backends/rawring.py) where that works.
    liburing_reason = liburing_unusable_reason()
    io_uring_reason = io_uring_unusable_reason()
    for item in items:
        need = _io_uring_need(item)
        reason = liburing_reason if need == "liburing" else io_uring_reason if need == "io_uring" else None
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"io_uring unusable here: {reason}"))
    if os.environ.get("AIOEXPERTS_REQUIRE_FIXTURES") == "1" and shared_fixtures_dir() is None:
        raise pytest.UsageError(
            "AIOEXPERTS_REQUIRE_FIXTURES=1 but no *.gguf is in "
            + " or ".join(map(str, _fixture_candidates()))
            + " (set AIOEXPERTS_FIXTURES)"
        )


def direct_io_unavailable(directory: Path) -> str | None:
    """Why ``O_DIRECT`` reads do not work on ``directory``'s file system, or None when they do.

    Probes with an aligned 4096-byte read of a scratch file (tmpfs accepts the open but serves the
    page cache: ``statx`` tells; the tests that need it check that separately).
    """
    probe = directory / f".o_direct_probe_{os.getpid()}"
    probe.write_bytes(b"\0" * 4096)
    try:
        try:
            fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            return f"O_DIRECT open refused on {directory} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
        buf = mmap.mmap(-1, 4096)
        from aioexperts._io.cachecheck import page_cache_reason, probe_page_cache

        try:
            os.preadv(fd, [buf], 0)
            cached = page_cache_reason(probe_page_cache(fd, str(probe), 4096, 4096))
        except OSError as exc:
            return f"O_DIRECT read refused on {directory} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
        finally:
            os.close(fd)
            buf.close()
        from aioexperts._io.align import probe_alignment

        if not probe_alignment(probe).direct_io_supported or cached is not None:
            return f"{directory} is on a file system without real direct I/O (tmpfs or similar): {cached}"
    finally:
        probe.unlink()
    return None


@pytest.fixture
def small_model(tmp_path: Path) -> Path:
    """A one-layer synthetic MoE GGUF (4 experts of 256x256, top-2) of this test's own, in ``tmp_path``."""
    from aioexperts.testing import SyntheticSpec, write_synthetic_model

    path = tmp_path / "small.gguf"
    write_synthetic_model(path, SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2))
    return path


@pytest.fixture
def direct_tmp_path(tmp_path: Path) -> Path:
    """``tmp_path``, or a skip (with the reason) where its file system cannot do ``O_DIRECT``."""
    reason = direct_io_unavailable(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    return tmp_path


#: Architectures of the shared fixtures whose MoE layers run but whose whole model ``load()``
#: refuses still (UnsupportedTypeError): the tests of the whole model expect that refusal, strictly,
#: so the day they run these marks must go.
WHOLE_MODEL_PENDING: dict[str, str] = {}


def whole_model_param(path: Path, *marks: pytest.MarkDecorator) -> object:
    """``pytest.param(path)``, strictly expected to be refused by ``load()`` when its architecture
    is in :data:`WHOLE_MODEL_PENDING`."""
    from aioexperts import UnsupportedTypeError, open_model

    arch = open_model(path).architecture
    if arch in WHOLE_MODEL_PENDING:
        marks = (
            *marks,
            pytest.mark.xfail(
                raises=UnsupportedTypeError, strict=True, reason=f"load() refuses {arch} ({WHOLE_MODEL_PENDING[arch]})"
            ),
        )
    return pytest.param(path, marks=marks, id=path.stem)


def golden_fixture_paths() -> list[Path]:
    """Every shared fixture (subfolders included) that has llama.cpp's MoE outputs (``.golden.npz``)."""
    return [p for p in shared_fixture_paths() if p.with_suffix(".golden.npz").exists()]


def golden_tolerance(path: Path) -> float:
    """Relative L2 allowed against llama.cpp (the fixtures README): F32 1e-5, BF16 1e-2, quantized and mixed 4e-2."""
    if path.stem.endswith("-f32"):
        return 1e-5
    if path.stem.endswith("-bf16"):
        return 1e-2
    return 4e-2


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    """``|got - want| / |want|`` in float64."""
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


#: The built-in full model's layout at a test size: 2 layers, small dims, a 600-token vocabulary.
TINY_FULL_SPEC_FIELDS = {
    "n_layer": 2,
    "n_embd": 256,
    "n_head": 4,
    "n_head_kv": 2,
    "head_dim": 64,
    "n_expert": 4,
    "n_expert_used": 2,
    "n_ff_exp": 256,
    "vocab_size": 600,
    "context_length": 512,
}


@pytest.fixture(scope="session")
def tiny_full_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small built-in full model (tokenizer, ChatML template, random weights), written once per session."""
    from aioexperts.testing._full_model import FullModelSpec, write_full_model

    path = tmp_path_factory.mktemp("fullmodel") / "tiny-full.gguf"
    return write_full_model(path, FullModelSpec(**TINY_FULL_SPEC_FIELDS))  # type: ignore[arg-type]
