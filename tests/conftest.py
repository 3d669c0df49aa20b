"""Shared test configuration: event-loop backends and the shared GGUF fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: Every async test marked ``anyio`` runs on each of these event loops.
ANYIO_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=ANYIO_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("AIOEXPERTS_REQUIRE_FIXTURES") == "1" and shared_fixtures_dir() is None:
        raise pytest.UsageError(
            "AIOEXPERTS_REQUIRE_FIXTURES=1 but no *.gguf is in "
            + " or ".join(map(str, _fixture_candidates()))
            + " (set AIOEXPERTS_FIXTURES)"
        )
