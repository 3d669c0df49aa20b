"""Every forward route gives the numbers saved before issue 32's restructuring, bit for bit.

The saved file (``tests/data/forward-baseline-<cpu>.npz``) is written by
``tests/model/forward_baseline.py``; a CPU kind without a file of its own is skipped with the
reason (the kernels' sums differ between AVX2 and AVX-512).
"""

from __future__ import annotations

import functools
from pathlib import Path

import anyio
import numpy as np
import pytest
from model.forward_baseline import baseline_path, builtin_numbers, cpu_kind, fixture_numbers, fixtures

pytestmark = pytest.mark.skipif(
    not baseline_path().exists(), reason=f"no saved forward baseline for this CPU kind ({cpu_kind()})"
)


@functools.cache
def saved() -> dict[str, np.ndarray]:
    with np.load(baseline_path()) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("path", fixtures(), ids=lambda p: p.stem)
def test_every_route_of_every_fixture_is_unchanged(path: Path) -> None:
    got = anyio.run(fixture_numbers, path)
    assert {k.split("/", 1)[1] for k in saved() if k.startswith(path.stem + "/")} == set(got)
    for key, value in got.items():
        np.testing.assert_array_equal(value, saved()[f"{path.stem}/{key}"], err_msg=f"{path.stem} {key}")


def test_the_builtin_models_greedy_tokens_are_unchanged(tiny_full_model: Path) -> None:
    got = anyio.run(builtin_numbers, tiny_full_model)
    np.testing.assert_array_equal(got["greedy"], saved()["builtin/greedy"])
