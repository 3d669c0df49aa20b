"""Fixtures of tests/serve: the shared server and the openai client (helpers in serving.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from aioexperts.serve import ServerOptions  # noqa: E402
from serve.serving import API_KEY, RAISING_TEMPLATE, ServerThread  # noqa: E402


@pytest.fixture(scope="session")
def serve_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny full model of tests/conftest.py, written with :data:`RAISING_TEMPLATE` as its chat template."""
    from conftest import TINY_FULL_SPEC_FIELDS

    from aioexperts.testing import _full_model

    path = tmp_path_factory.mktemp("serve") / "tiny-serve.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_full_model, "CHATML_TEMPLATE", RAISING_TEMPLATE)
        return _full_model.write_full_model(path, _full_model.FullModelSpec(**TINY_FULL_SPEC_FIELDS))  # type: ignore[arg-type]


@pytest.fixture(scope="package")  # stopped when tests/serve is done
def served(serve_model: Path) -> Iterator[ServerThread]:
    """The shared server: 2 sequences at once, 8 may wait, an API key, a 64 KiB body limit."""
    options = ServerOptions(port=0, parallel=2, queue_size=8, api_key=API_KEY, max_body_bytes=64 << 10)
    thread = ServerThread(serve_model, options).start()
    yield thread
    thread.stop()


@pytest.fixture
def client(served: ServerThread) -> Iterator[Any]:
    """The official openai client against the shared server (no retries: every error is seen)."""
    with openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c
