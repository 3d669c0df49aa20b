"""The router's F32 product: ggml's ``ggml_vec_dot_f32`` sums (AVX2 build) in every path, the
decode row's fan-out split any way, batch rows each their one-row bits."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from aioexperts._compute import fused
from aioexperts._compute.grouped import f32_split_plan
from aioexperts._compute.kernels import floats
from aioexperts._compute.moe import ResidentLayer, router_logits, router_row_logits
from aioexperts._errors import ConfigError, InvalidRequestError

needs_numba = pytest.mark.skipif(fused.backend().name != "numba", reason="the compiled product needs numba")


def ggml_vec_dot_f32_avx2(w: np.ndarray, x: np.ndarray) -> np.float32:
    """ggml-cpu/vec.cpp ``ggml_vec_dot_f32`` of the AVX2 build, literally: ``GGML_F32_STEP`` 32 as
    four 8-lane FMA accumulators (an FMA rounds once: float32 products are exact in float64),
    ``GGML_F32_VEC_REDUCE``, then the leftovers in order."""
    n = len(x)
    np32 = n - n % 32
    acc = np.zeros(32, dtype=np.float32)
    for i in range(0, np32, 32):
        acc = (w[i : i + 32].astype(np.float64) * x[i : i + 32] + acc).astype(np.float32)
    x16 = acc[:16] + acc[16:]  # sum[0] += sum[2], sum[1] += sum[3]
    x8 = x16[:8] + x16[8:]  # sum[0] += sum[1]
    x4 = x8[:4] + x8[4:]  # the two 128-bit halves
    s = np.float32((x4[0] + x4[1]) + (x4[2] + x4[3]))  # two hadds
    for k in range(np32, n):
        s = np.float32(s + np.float32(w[k] * x[k]))
    return s


def _router(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)


@needs_numba
@pytest.mark.parametrize("cols", [2048, 2048 + 7, 24, 96])
def test_a_decode_rows_logits_are_ggml_vec_dot_f32(cols: int) -> None:
    router = _router(40, cols)
    resident = ResidentLayer(layer=0, router=router)
    rng = np.random.default_rng(1)
    for scale in (1.0, 30.0, 1e-3):
        x = (rng.standard_normal((1, cols)) * scale).astype(np.float32)
        got = router_logits(x, resident)
        want = np.array([ggml_vec_dot_f32_avx2(router[r], x[0]) for r in range(len(router))], dtype=np.float32)
        assert got.dtype == np.float32 and got.shape == (1, len(router))
        assert np.array_equal(got[0].view(np.uint32), want.view(np.uint32))


@needs_numba
def test_the_fan_outs_split_does_not_change_a_bit() -> None:
    router = _router(128, 2048)
    x = np.random.default_rng(2).standard_normal((1, 2048)).astype(np.float32)
    outs = []
    for parts in (1, 2, 3, 128, 500):
        plan = f32_split_plan(router, parts)
        assert plan is not None and len(plan.addresses) == min(parts, 128)
        out = np.full(128, np.nan, dtype=np.float32)
        assert plan.run(x, out)
        outs.append(out)
    for out in outs[1:]:
        assert np.array_equal(out.view(np.uint32), outs[0].view(np.uint32))


@needs_numba
@pytest.mark.parametrize("invariant", [False, True])
def test_every_row_of_a_batch_is_its_one_row_result(invariant: bool) -> None:
    router = _router(64, 512)
    bias = np.linspace(-1, 1, 64, dtype=np.float32)
    resident = ResidentLayer(layer=0, router=router, router_bias=bias)
    x = np.random.default_rng(3).standard_normal((7, 512)).astype(np.float32)
    batch = router_logits(x, resident, invariant=invariant)
    for i in range(len(x)):
        one = router_logits(x[i : i + 1], resident)
        assert np.array_equal(batch[i].view(np.uint32), one[0].view(np.uint32))
    want = np.array([ggml_vec_dot_f32_avx2(router[r], x[6]) for r in range(64)], dtype=np.float32) + bias
    assert np.array_equal(batch[6].view(np.uint32), want.view(np.uint32))


@needs_numba
def test_a_row_that_is_not_finite_is_declined_and_blas_serves() -> None:
    router = _router(16, 64)
    resident = ResidentLayer(layer=0, router=router)
    raw = router.view(np.uint8)
    for bad in (np.nan, np.inf):
        x = np.ones((2, 64), dtype=np.float32)
        x[1, 5] = bad
        out = np.zeros((2, 16), dtype=np.float32)
        assert not floats.matmat_f32_rows(raw, x, out)
        assert not floats.matvec_f32_row(raw, x[1], out[0])
        with np.errstate(invalid="ignore"):
            assert not np.isfinite(router_logits(x, resident)[1]).any()
        row = np.zeros(16, dtype=np.float32)
        with np.errstate(invalid="ignore"):
            router_row_logits(x[1:], resident, row)
        assert not np.isfinite(row).any()  # the BLAS product of a NaN/inf row


def test_without_numba_the_logits_are_blas() -> None:
    router = _router(32, 256)
    resident = ResidentLayer(layer=0, router=router)
    x = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
    fused.set_backend("numpy")
    try:
        one = router_logits(x[:1], resident)
        rows = router_logits(x, resident, invariant=True)
    finally:
        fused.set_backend(None)
    assert np.array_equal(one[0], np.matmul(x[0], router.T))
    for i in range(3):
        assert np.array_equal(rows[i], np.matmul(x[i], router.T))


@needs_numba
def test_a_split_plan_refuses_what_is_not_a_contiguous_float32_matrix() -> None:
    with pytest.raises(ConfigError, match="float64"):
        f32_split_plan(np.zeros((4, 4), dtype=np.float64), 2)
    with pytest.raises(ConfigError, match="float32"):
        f32_split_plan(np.zeros((4, 4), dtype=">f4"), 2)
    with pytest.raises(ConfigError, match="C-contiguous"):
        f32_split_plan(np.zeros((4, 8), dtype=np.float32)[:, ::2], 2)
    with pytest.raises(ConfigError, match="parts"):
        f32_split_plan(np.zeros((4, 4), dtype=np.float32), 0)


@needs_numba
@pytest.mark.parametrize("invariant", [False, True])
def test_a_row_that_is_not_finite_leaves_the_other_rows_their_own_bits(invariant: bool) -> None:
    router = _router(16, 70)
    resident = ResidentLayer(layer=0, router=router)
    x = np.random.default_rng(6).standard_normal((4, 70)).astype(np.float32)
    x[2, 5] = np.nan
    with np.errstate(invalid="ignore"):
        batch = router_logits(x, resident, invariant=invariant)
    for i in (0, 1, 3):
        one = router_logits(x[i : i + 1], resident)
        assert np.array_equal(batch[i].view(np.uint32), one[0].view(np.uint32))
    assert not np.isfinite(batch[2]).any()


def test_a_decode_rows_arguments_are_checked_before_the_product() -> None:
    router = _router(64, 256)
    resident = ResidentLayer(layer=0, router=router)
    good_x, good_out = np.ones((1, 256), np.float32), np.zeros(64, np.float32)
    for x in (np.ones((1, 256), np.float64), np.ones((1, 512), np.float32)[:, ::2], np.ones((1, 200), np.float32)):
        with pytest.raises(InvalidRequestError):
            router_row_logits(x, resident, good_out)
    for out in (np.zeros(2, np.float32), np.zeros(64, np.float64), np.zeros(128, np.float32)[::2]):
        with pytest.raises(ConfigError):
            router_row_logits(good_x, resident, out)
    router_row_logits(good_x, resident, good_out)
    np.testing.assert_allclose(good_out, router.sum(axis=1), rtol=1e-4, atol=1e-4)


def test_a_resident_layer_is_copied_without_its_plans() -> None:
    router = _router(32, 256)
    resident = ResidentLayer(layer=3, router=router, router_bias=np.ones(32, np.float32))
    x = np.random.default_rng(7).standard_normal((1, 256)).astype(np.float32)
    want = router_logits(x, resident)  # makes and keeps a plan where numba serves
    for copied in (pickle.loads(pickle.dumps(resident)), copy.deepcopy(resident)):
        assert copied._row_plans == {} and copied.layer == 3
        np.testing.assert_array_equal(copied.router, router)
        assert np.array_equal(router_logits(x, copied).view(np.uint32), want.view(np.uint32))


@needs_numba
@pytest.mark.parametrize("parts", [1.5, "2", None, float("nan"), True])
def test_a_split_plans_parts_must_be_a_positive_int(parts: object) -> None:
    with pytest.raises(ConfigError, match="parts"):
        f32_split_plan(np.zeros((4, 4), dtype=np.float32), parts)  # type: ignore[arg-type]
