"""Every Python example of README.md, docs/*.md and the docstrings runs as printed, on the built-in model.

Which blocks count: every fenced block whose info string is ``python`` (or ``py``) in README.md and
docs/*.md (docs/notes/, design notes, is left out), and the ``Example::`` literal block of every
docstring under aioexperts/ (the doctest of :mod:`aioexperts.testing` runs through ``doctest``).
The examples get the model from ``aioexperts.testing.builtin_model_path()``. Here each runs as a
script in a fresh subprocess with ``$AIOEXPERTS_BUILTIN_SIZE=tiny`` and ``$AIOEXPERTS_CACHE`` in a
temporary folder, so the model they open is the built-in one's architecture at a test size
(written once, in about a second), never the 2.9 GB file. The blocks of one page run in order in
one folder of their own, so a block may use the files an earlier block of its page wrote
(``placement.json``).

A line right above a block's fence may say how it runs (keep them few):

- ``<!-- docs-example: not run: REASON -->``: not a runnable program (a reason is required);
- ``<!-- docs-example: needs a server -->``: a client of ``aioexperts-serve``; the test starts one
  on the built-in model on a free port and points the example's ``127.0.0.1:8080`` at it.

A block that imports ``ray`` starts a local Ray cluster: it is marked ``ray`` (``make test`` runs it
in its second pass).
"""

from __future__ import annotations

import ast
import doctest
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aioexperts._compute.jit import cache_dir as jit_cache_dir

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!-- docs-example: (?P<marker>[^>]*?) -->\s*$")
_PYTHON = {"python", "py", "python3"}
_SERVER_URL = "http://127.0.0.1:8080"


@dataclass(frozen=True)
class Example:
    doc: Path
    line: int
    code: str
    marker: str | None

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def opt_out(self) -> str | None:
        """The reason it is not run, or None."""
        if self.marker is None or not self.marker.startswith("not run:"):
            return None
        return self.marker.removeprefix("not run:").strip()

    @property
    def needs_server(self) -> bool:
        return self.marker == "needs a server"

    @property
    def uses_ray(self) -> bool:
        return re.search(r"^\s*(import|from)\s+ray\b|^\s*import .*\bray\b", self.code, re.M) is not None


def python_examples(text: str, doc: Path) -> list[Example]:
    """The ``python`` fenced blocks of ``text`` (each with its first line and the marker above it)."""
    found = []
    for m in _FENCE.finditer(text):
        if m["info"].strip().split(" ")[0] not in _PYTHON:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        found.append(Example(doc, text.count("\n", 0, m.start()) + 1, m["body"], marker["marker"] if marker else None))
    return found


def docstring_examples(path: Path) -> list[Example]:
    """The ``Example::`` literal blocks of the docstrings of ``path`` (a module of aioexperts)."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or "Example::" not in doc:
            continue
        lines = doc.split("Example::", 1)[1].split("\n")[1:]
        body: list[str] = []
        for line in lines:
            if line.strip() and not line.startswith(" "):
                break
            body.append(line)
        code = textwrap.dedent("\n".join(body)).strip("\n") + "\n"
        found.append(Example(path, getattr(node, "lineno", 1), code, None))
    return found


EXAMPLES = [ex for doc in DOCS for ex in python_examples(doc.read_text(), doc)] + [
    ex for module in sorted((ROOT / "aioexperts").rglob("*.py")) for ex in docstring_examples(module)
]


def test_the_extraction_finds_the_blocks_and_their_markers(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    text = (
        "```python\nprint(1)\n```\n\n```sh\nls\n```\n"
        "<!-- docs-example: not run: needs a cluster -->\n```python\nimport asyncio, ray\n```\n"
        "- item:\n\n  ```py\n  x = 1\n  ```\n"
        "<!-- docs-example: needs a server -->\n```python\nimport openai\n```\n"
    )
    found = python_examples(text, doc)
    assert [(e.line, e.code, e.opt_out, e.needs_server, e.uses_ray) for e in found] == [
        (1, "print(1)\n", None, False, False),
        (9, "import asyncio, ray\n", "needs a cluster", False, True),
        (14, "  x = 1\n", None, False, False),
        (18, "import openai\n", None, True, False),
    ]


def test_docstring_examples_are_found(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        '''"""Module.

Example::

    import asyncio
    asyncio.run(main())

More text.
"""


def f():
    """F.

    Example::

        x = 1

            y = 2
    Args:
        none
    """
'''
    )
    found = docstring_examples(module)
    assert [(e.line, e.code) for e in found] == [
        (1, "import asyncio\nasyncio.run(main())\n"),
        (12, "x = 1\n\n    y = 2\n"),
    ]


def test_the_docs_have_python_examples_and_every_marker_is_known() -> None:
    names = {ex.doc.name for ex in EXAMPLES}
    assert {"README.md", "text.md", "model.md", "distributed.md", "serving.md"} <= names
    assert {"_store.py", "_runner.py", "model.py", "runner.py", "__init__.py"} <= names  # docstrings
    for ex in EXAMPLES:
        assert ex.marker is None or ex.opt_out or ex.needs_server, f"{ex.name}: unknown marker {ex.marker!r}"
    assert sum(ex.opt_out is not None for ex in EXAMPLES) <= 2, [ex.name for ex in EXAMPLES if ex.opt_out]


@pytest.fixture(scope="module")
def example_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("docs-cache")
    (cache / "numba").symlink_to(jit_cache_dir().parent)  # this session's compiled kernels, not a recompile
    return {
        **os.environ,
        "AIOEXPERTS_CACHE": str(cache),
        "AIOEXPERTS_BUILTIN_SIZE": "tiny",
        "PYTHONPATH": str(ROOT),  # this checkout's aioexperts
    }


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, tuple[Path, set[int]]]:
    """Per page (or module): its working folder and the lines of the blocks already run there."""
    return {doc: (tmp_path_factory.mktemp(doc.stem), set()) for doc in {ex.doc for ex in EXAMPLES}}


@pytest.fixture
def server_url(example_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """``aioexperts-serve`` on the built-in (tiny) model, on a free port."""
    model = subprocess.run(
        [sys.executable, "-c", "from aioexperts.testing import builtin_model_path; print(builtin_model_path())"],
        env=example_env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aioexperts.cli.serve", model, "--port", "0", "--io", "threads", "--ctx", "1024"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=example_env,
        )
    try:
        deadline = time.monotonic() + 120
        while (found := re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())) is None:
            assert proc.poll() is None and time.monotonic() < deadline, f"aioexperts-serve: {log.read_text()}"
            time.sleep(0.2)
        yield found.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run(example: Example, cwd: Path, env: dict[str, str], code: str | None = None) -> None:
    script = cwd / f"example_{example.line}.py"
    script.write_text(example.code if code is None else code)
    done = subprocess.run([sys.executable, script.name], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{example.name} failed:\n{done.stderr[-4000:]}"


def _params() -> Iterator[object]:
    for ex in EXAMPLES:
        marks = [pytest.mark.ray] if ex.uses_ray else []
        yield pytest.param(ex, id=ex.name, marks=marks)


@pytest.mark.parametrize("example", list(_params()))
def test_the_example_runs_as_printed(
    example: Example, example_env: dict[str, str], doc_runs: dict[Path, tuple[Path, set[int]]], request
) -> None:
    if example.opt_out is not None:
        pytest.skip(f"opted out in the doc: {example.opt_out}")
    cwd, done = doc_runs[example.doc]
    for earlier in EXAMPLES:  # the page's earlier blocks first (once), as a reader runs them
        if earlier.doc == example.doc and earlier.line < example.line and earlier.line not in done:
            if earlier.opt_out is None and not earlier.needs_server:
                _run(earlier, cwd, example_env)
            done.add(earlier.line)
    code = None
    if example.needs_server:
        url = request.getfixturevalue("server_url")
        assert _SERVER_URL in example.code, f"{example.name}: a server example talks to {_SERVER_URL}"
        code = example.code.replace(_SERVER_URL, url)
    _run(example, cwd, example_env, code)
    done.add(example.line)


def test_the_doctest_of_aioexperts_testing_runs() -> None:
    import aioexperts.testing

    result = doctest.testmod(aioexperts.testing, verbose=False)
    assert result.attempted >= 3 and result.failed == 0
