"""Every shared fixture (``more-archs/`` included) through ``MoERunner.moe_result`` with each kernel backend.

With the compiled kernels (float and int8 precision) and with the numpy kernels forced, the outputs
must match llama.cpp's goldens within the tolerances of ``tests/store/test_moe_golden.py`` (for the
architectures whose routing is verified against llama.cpp), and the float kernels of the two
backends must agree with each other within 1e-5 relative whatever the architecture.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import golden_fixture_paths, golden_tolerance, rel_l2, shared_fixtures_dir

import aioexperts
from aioexperts._compute import fused

pytestmark = pytest.mark.anyio

#: relative L2 distance allowed between the compiled and the numpy kernels
BACKENDS_RTOL = 1e-5


FIXTURES = golden_fixture_paths()
tolerance = golden_tolerance


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the event loops are covered by tests/store; this file is about the kernels


@pytest.fixture(autouse=True)
def restore_backend() -> Iterator[None]:
    yield
    fused.set_backend(None)
    fused.set_precision(None)


async def outputs(path: Path, backend: str, precision: str = "float") -> tuple[dict[int, aioexperts.MoEResult], bool]:
    """Every golden layer's ``moe_result`` with ``backend``, and whether the arch is verified."""
    fused.set_backend(backend)  # type: ignore[arg-type]
    fused.set_precision(precision)  # type: ignore[arg-type]
    assert fused.backend().name == backend, fused.backend().reason
    golden = np.load(path.with_suffix(".golden.npz"))
    results = {}
    async with aioexperts.open(path, slots=4) as store:
        runner = aioexperts.MoERunner(store)
        for layer in store.layout.layers:
            if f"moe_in-{layer}" in golden:
                x = np.atleast_2d(golden[f"moe_in-{layer}"]).astype(np.float32)
                results[layer] = await runner.moe_result(layer, x)
        return results, store.hparams.verified


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
async def test_both_backends_match_llama_cpp_and_each_other(path: Path, anyio_backend: object) -> None:
    golden = np.load(path.with_suffix(".golden.npz"))
    compiled, verified = await outputs(path, "numba")
    int8, _ = await outputs(path, "numba", "int8")
    reference, _ = await outputs(path, "numpy")
    assert compiled and compiled.keys() == reference.keys() == int8.keys()
    for layer, ours in compiled.items():
        theirs = reference[layer]
        np.testing.assert_array_equal(ours.ids, theirs.ids)
        np.testing.assert_array_equal(int8[layer].ids, theirs.ids)
        assert rel_l2(ours.ffn_out, theirs.ffn_out.astype(np.float64)) <= BACKENDS_RTOL
        if not verified:
            continue  # an architecture outside llama.cpp's checked list: only the kernels are compared
        for result in (ours, int8[layer], theirs):
            np.testing.assert_array_equal(result.ids, np.atleast_2d(golden[f"topk-{layer}"]))
            assert rel_l2(result.moe_out, np.atleast_2d(golden[f"moe_out-{layer}"])) <= tolerance(path)
            if f"shared_out-{layer}" in golden:
                assert result.shared_out is not None
                assert rel_l2(result.shared_out, np.atleast_2d(golden[f"shared_out-{layer}"])) <= tolerance(path)
            if f"ffn_out-{layer}" in golden:
                assert rel_l2(result.ffn_out, np.atleast_2d(golden[f"ffn_out-{layer}"])) <= tolerance(path)


def test_the_more_archs_fixtures_are_seen() -> None:
    if shared_fixtures_dir() is None:
        pytest.skip("shared fixtures not found")
    assert any("more-archs" in str(p) for p in FIXTURES)
