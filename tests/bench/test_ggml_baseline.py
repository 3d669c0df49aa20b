"""ggml's own mat-vec as the kernels bench's baseline (``aioexperts_bench.ggml_baseline``, issue 20).

The tests that run ggml need llama-cpp-python (the ``baseline`` extra) and are skipped without it;
the others check what the bench does without it, and the errors of the binding.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from aioexperts import ConfigError, FormatError, OptionalDependencyError, UnsupportedTypeError
from aioexperts._compute import fused
from aioexperts._format import dequant
from aioexperts_bench import BaselineMismatchError, ggml_baseline

Q = GGMLQuantizationType
BENCH = Path(__file__).parents[2] / "bench"
GGML_REASON = ggml_baseline.unavailable_reason()
needs_ggml = pytest.mark.skipif(GGML_REASON is not None, reason=f"no ggml baseline: {GGML_REASON}")
#: small matrices: 2 k-quant blocks per row
SHAPE = (48, 512)


@pytest.fixture(scope="module")
def bench_kernels() -> Iterator[ModuleType]:
    """``bench/kernels.py`` as a module (it imports its sibling scripts by name)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_kernels_under_test", BENCH / "kernels.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def bench_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report_under_test", BENCH / "report_extra.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def matrix(qtype: Q, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """The same blocks the bench builds (``bench/dequant.py``'s ``make_tensor``), flat uint8."""
    sys.path.insert(0, str(BENCH))
    try:
        from dequant import make_tensor
    finally:
        sys.path.remove(str(BENCH))
    return np.ascontiguousarray(make_tensor(qtype, shape, np.random.default_rng(seed)).reshape(-1))


def exact_product(raw: np.ndarray, qtype: Q, shape: tuple[int, int], x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` in float64 from the numpy reference dequantization (not the compiled kernels)."""
    w = dequant.dequantize(memoryview(raw).toreadonly(), qtype, shape).astype(np.float64)
    return (x.astype(np.float64) @ w.T).reshape(1, -1)


def test_without_llama_cpp_the_bench_says_unmeasured(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    bench_kernels: ModuleType,
    bench_report: ModuleType,
) -> None:
    """No typed figure stands in for ggml: without the extra, every x ggml cell says unmeasured."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(ggml_baseline, "_LIBRARY", None)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a)
    )
    assert not hasattr(bench_kernels, "GGML_GBPS")
    lib, info = bench_kernels.ggml_baseline_for_run()
    assert lib is None and info["measured"] is False
    assert "llama-cpp-python" in info["reason"] and "aioexperts[baseline]" in info["reason"]

    _, result = bench_kernels.run_kernels([Q.Q8_0], 1, 2, 0, shapes=((32, 256),), cold_bytes=1 << 15, ggml=lib)
    entry = result["Q8_0 32x256"]
    assert "ggml" not in entry["gbps"] and "ggml_agreement" not in entry
    assert not [k for k in entry if k.startswith("x_ggml")]
    assert entry["x_gguf_float"]["median"] > 0  # the rest of the row was measured

    bench_kernels.print_table(result, info)
    out = capsys.readouterr().out
    assert f"x ggml unmeasured: {info['reason']}" in out
    row = next(line for line in out.splitlines() if line.startswith("Q8_0"))
    assert row.count("unmeasured") == 2  # float and int8

    results = {
        "parameters": {"targets": {"x_gguf": 20.0, "x_ggml": 0.7}, "ggml": info, "batches": [4, 16, 64, 256]},
        "summary": {"kernels": result},
        "machine": {},
    }
    table = bench_report.kernels(results)
    line = next(line for line in table.splitlines() if line.startswith("| Q8_0"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == cells[7] == cells[8] == "unmeasured"
    assert f"x ggml unmeasured: {info['reason']}" in table


def test_no_ggml_flag_leaves_it_unmeasured(bench_kernels: ModuleType) -> None:
    lib, info = bench_kernels.ggml_baseline_for_run(enabled=False)
    assert lib is None and info == {"measured": False, "reason": "--no-ggml given"}


def test_missing_libraries_and_symbols_are_named(tmp_path: Path) -> None:
    with pytest.raises(OptionalDependencyError, match="no libggml-base.so"):
        ggml_baseline.GgmlLibrary(tmp_path)
    libm = next(
        (p for p in (Path("/lib/x86_64-linux-gnu/libm.so.6"), Path("/usr/lib64/libm.so.6")) if p.exists()), None
    )
    if libm is None:
        pytest.skip("no libm.so.6 to stand in for a library without ggml's functions")
    for stem in ("libggml-base", "libggml-cpu"):
        shutil.copy(libm, tmp_path / f"{stem}.so")
    with pytest.raises(OptionalDependencyError, match="libggml-base.so has no function ggml_tensor_overhead"):
        ggml_baseline.GgmlLibrary(tmp_path)


@needs_ggml
@pytest.mark.parametrize("qtype", sorted(fused.compiled_types(), key=lambda q: q.name), ids=lambda q: q.name)
def test_ggml_matvec_agrees_with_the_exact_product_and_our_kernels(qtype: Q) -> None:
    raw = matrix(qtype, SHAPE)
    x = np.random.default_rng(1).standard_normal((1, SHAPE[1])).astype(np.float32)
    want = exact_product(raw, qtype, SHAPE, x)
    with ggml_baseline.GgmlMatVec(raw, qtype, SHAPE) as mv:
        got = mv(x)
        again = mv(x)
    assert got.shape == (1, SHAPE[0]) and got.dtype == np.float32
    np.testing.assert_array_equal(got, again)  # deterministic, the scratch context reset between calls
    err = ggml_baseline.check_agreement(got, want, qtype)
    assert err > 0 or qtype == Q.F32
    ours = fused.linear(memoryview(raw).toreadonly(), qtype, SHAPE, x)
    ggml_baseline.check_agreement(got, ours, qtype)
    if qtype in fused.int8_types():
        # the int8 kernels round x to the same 8-bit blocks as ggml: only the order of the float sums differs
        fused.set_precision("int8")
        try:
            ours_int8 = fused.linear(memoryview(raw).toreadonly(), qtype, SHAPE, x)
        finally:
            fused.set_precision(None)
        assert ggml_baseline.relative_error(got, ours_int8) < 1e-5


#: the int8 types whose kernels follow ggml's AVX2 loop operation for operation (the integer sums
#: per 8 lanes, one fused multiply-add per block, ggml's horizontal sum): ggml's bits on AVX2 (Q5_K's
#: ``summs += dmin * sum`` as one fused multiply-add: what GCC's default contraction makes of it)
GGML_ORDER_TYPES = (Q.IQ4_XS, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.Q4_0, Q.Q4_K, Q.Q5_0, Q.Q5_K, Q.Q6_K, Q.Q8_0)


def _avx2_without_avx512() -> bool:
    from aioexperts._compute.kernels import rowdot, simd

    return rowdot._avx2() and "+avx512f" not in simd._target_features()[1]


@needs_ggml
@pytest.mark.skipif(not _avx2_without_avx512(), reason="ggml's AVX2 loops are the ones the kernels follow")
@pytest.mark.parametrize("qtype", GGML_ORDER_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [512, 2048])
def test_int8_kernels_in_ggml_order_give_ggml_bits(qtype: Q, cols: int) -> None:
    shape = (40, cols)
    raw = matrix(qtype, shape, seed=cols)
    x = np.random.default_rng(cols + 1).standard_normal((1, cols)).astype(np.float32)
    with ggml_baseline.GgmlMatVec(raw, qtype, shape) as mv:
        got = mv(x)
    fused.set_precision("int8")
    try:
        ours = fused.linear(memoryview(raw).toreadonly(), qtype, shape, x)
    finally:
        fused.set_precision(None)
    np.testing.assert_array_equal(ours, got)


@needs_ggml
@pytest.mark.parametrize(("stored", "told"), [(Q.IQ4_NL, Q.Q4_0), (Q.BF16, Q.F16)], ids=lambda q: q.name)
def test_bytes_read_as_another_type_fail_the_agreement_check(stored: Q, told: Q) -> None:
    """Same block size and bytes, another decoding: the check must notice."""
    assert GGML_QUANT_SIZES[stored] == GGML_QUANT_SIZES[told]
    raw = matrix(stored, SHAPE)
    x = np.random.default_rng(1).standard_normal((1, SHAPE[1])).astype(np.float32)
    with ggml_baseline.GgmlMatVec(raw, told, SHAPE) as mv:
        got = mv(x)
    with pytest.raises(BaselineMismatchError, match=f"ggml's {stored.name} mat-vec and ours disagree"):
        ggml_baseline.check_agreement(got, exact_product(raw, stored, SHAPE, x), stored)


@needs_ggml
def test_bad_arguments_raise_before_ggml_sees_them() -> None:
    raw = matrix(Q.Q4_K, SHAPE)
    with pytest.raises(FormatError, match="do not hold a 48 x 512 Q4_K matrix"):
        ggml_baseline.GgmlMatVec(raw[:-1], Q.Q4_K, SHAPE)
    with pytest.raises(ConfigError, match="not whole Q4_K blocks"):
        ggml_baseline.GgmlMatVec(raw, Q.Q4_K, (96, 256 + 32))
    with pytest.raises(UnsupportedTypeError, match="does not run IQ2_XXS"):
        ggml_baseline.GgmlMatVec(raw, Q.IQ2_XXS, SHAPE)
    with pytest.raises(UnsupportedTypeError, match="unknown"):
        ggml_baseline.GgmlMatVec(raw, 4, SHAPE)
    with pytest.raises(ConfigError, match="n_threads"):
        ggml_baseline.GgmlMatVec(raw, Q.Q4_K, SHAPE, n_threads=0)
    mv = ggml_baseline.GgmlMatVec(raw, Q.Q4_K, SHAPE)
    with pytest.raises(ConfigError, match="512 float32 values"):
        mv.set_input(np.zeros(511, np.float32))
    with pytest.raises(ConfigError, match="512 float32 values"):
        mv.set_input(np.zeros(512, np.float64))
    mv.close()
    mv.close()
    with pytest.raises(ConfigError, match="closed"):
        mv.compute()
    with pytest.raises(ConfigError, match="closed"):
        mv.set_input(np.zeros(512, np.float32))


@needs_ggml
def test_the_bench_times_ggml_in_the_same_rounds(bench_kernels: ModuleType) -> None:
    lib, info = bench_kernels.ggml_baseline_for_run()
    assert lib is not None and info["measured"] is True and info["threads"] == 1
    rounds, result = bench_kernels.run_kernels([Q.Q4_K], 2, 3, 0, shapes=((32, 256),), cold_bytes=1 << 15, ggml=lib)
    entry = result["Q4_K 32x256"]
    per_round = {(r["round"], r["method"]): r["seconds"] for r in rounds}
    assert {m for _, m in per_round} >= {"ggml", "float", "int8"}
    for prec in ("float", "int8"):
        ratios = sorted(per_round[(r, "ggml")] / per_round[(r, prec)] for r in range(2))
        assert entry[f"x_ggml_{prec}"]["min"] == pytest.approx(ratios[0])
        assert entry[f"x_ggml_{prec}"]["max"] == pytest.approx(ratios[-1])
    agreed = entry["ggml_agreement"]
    assert 0 < agreed["vs_float"] <= agreed["tolerance"] and agreed["vs_int8"] < agreed["vs_float"]
