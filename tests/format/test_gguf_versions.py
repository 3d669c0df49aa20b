"""The format and executor tests pass against the oldest and the newest ``gguf`` that pyproject.toml allows.

Each version is installed (``pip install --no-deps --target``, the other dependencies come from this
environment) into a temporary folder that is put first on ``PYTHONPATH`` of a child pytest run.
gguf 0.17.x is not allowed: it has no ``GGMLQuantizationType.MXFP4``, which the dequantization
kernels register, so ``import aioexperts`` fails with it.

Needs PyPI. Where the index cannot be reached the test is skipped, except under ``.ci/run``
(``AIOEXPERTS_REQUIRE_FIXTURES=1``), where it fails: CI cannot pass by skipping.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLDEST, NEWEST = "0.18.0", "0.19.0"
#: what the child run covers: every format test, the executor against the goldens and the references
SUITES = ["tests/format", "tests/compute/test_moe.py", "tests/compute/test_arch_reference.py"]


def _gguf_requirement() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"gguf([^"]*)"', text)
    assert m is not None, "pyproject.toml names no gguf requirement"
    return m[1]


def test_the_tested_versions_are_the_ends_of_the_allowed_range() -> None:
    assert _gguf_requirement() == ">=0.18,<0.20", "update OLDEST/NEWEST (and this check) with the gguf range"


def _install(version: str, target: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), f"gguf=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        message = f"cannot install gguf=={version}: {proc.stderr.strip()[-500:]}"
        if os.environ.get("AIOEXPERTS_REQUIRE_FIXTURES") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_suites_pass_with_gguf(version: str, tmp_path: Path) -> None:
    if version == importlib.metadata.version("gguf"):
        # this run itself imports that version: the suites below are part of it
        pytest.skip(f"this test run uses gguf {version} itself")
    target = tmp_path / "site"
    _install(version, target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m, gguf; print(m.version('gguf'), gguf.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    got_version, got_file = probe.stdout.split()
    assert got_version == version
    assert got_file.startswith(str(target))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *SUITES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=850,
        check=False,
    )
    tail = "\n".join(run.stdout.splitlines()[-25:])
    assert run.returncode == 0, f"with gguf {version}:\n{tail}\n{run.stderr[-2000:]}"
    assert re.search(r"\d+ passed", tail), tail
