"""One token's experts in groups (``aioexperts._compute.decode_experts``, ``grouped``): the same bits
as the general path (``fused.linear`` per product, one pool item per expert), for every int8 type,
mixed gate/up types, every split; a non-finite value falls back to the general path; what the
group path does not serve (mixed banks, biases, padding, float precision) takes the general one."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from test_kernels import sane_blocks

from aioexperts._compute import decode_experts, fused, grouped
from aioexperts._compute import moe as moe_module
from aioexperts._compute.glu import swiglu
from aioexperts._compute.moe import ResidentLayer, expert_outputs, plan_moe
from aioexperts._compute.pool import configure_compute_pool
from aioexperts._errors import ConfigError, FormatError
from aioexperts._format.hparams import MoEHParams
from aioexperts._format.views import ExpertTable, ExpertView, ProjectionView, layout_key

Q = GGMLQuantizationType
N_EMBD, N_FF = 512, 256
INT8_TYPES = sorted(fused.int8_types(), key=lambda t: t.name)


@pytest.fixture(autouse=True)
def int8_numba() -> Iterator[None]:
    fused.set_backend(None)
    fused.set_precision("int8")
    assert fused.backend().name == "numba", fused.backend().reason
    configure_compute_pool(2)
    yield
    fused.set_precision(None)


def _proj(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> ProjectionView:
    raw = sane_blocks(qtype, shape[0], shape[1], rng)
    return ProjectionView(memoryview(raw.tobytes()).toreadonly(), qtype, shape)


def _views(n: int, gate_t: Q, down_t: Q, rng: np.random.Generator, up_t: Q | None = None) -> dict[int, ExpertView]:
    up_t = up_t or gate_t
    return {
        e: ExpertView(
            0,
            e,
            0,
            _proj(gate_t, (N_FF, N_EMBD), rng),
            _proj(up_t, (N_FF, N_EMBD), rng),
            _proj(down_t, (N_EMBD, N_FF), rng),
        )
        for e in range(n)
    }


def _general(monkeypatch: pytest.MonkeyPatch, *args, **kw):
    with monkeypatch.context() as m:
        m.setattr(moe_module, "_group_classes", lambda *a: None)
        return expert_outputs(*args, **kw)


def _one_token(rng: np.random.Generator, n_expert: int, k: int, x: np.ndarray | None = None):
    hp = MoEHParams(arch="test", n_layer=1, n_embd=N_EMBD, n_expert=n_expert, n_expert_used=k, n_ff_exp=N_FF)
    res = ResidentLayer(layer=0, router=rng.standard_normal((n_expert, N_EMBD), dtype=np.float32))
    x = rng.standard_normal((1, N_EMBD), dtype=np.float32) if x is None else x
    ids = rng.permutation(n_expert)[:k][None, :].astype(np.int32)
    weights = rng.random((1, k), dtype=np.float32)
    return plan_moe(x, ids, weights, res, hp), ids[0].tolist()


def _assert_same(got, want) -> None:
    assert sorted(got.rows) == sorted(want.rows)
    for e in want.rows:
        assert np.array_equal(got.rows[e], want.rows[e]), e


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
def test_groups_give_the_general_paths_bits(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(qtype.value)
    down_t = Q.Q6_K if qtype != Q.Q6_K else Q.Q4_K
    views = _views(8, qtype, down_t, rng)
    plan, ids = _one_token(rng, 8, 6)
    calls = []
    real = grouped.matvec_group
    monkeypatch.setattr(decode_experts, "matvec_group", lambda *a: calls.append(a[0]) or real(*a))
    (got,) = expert_outputs([plan], views, ids, shared=False)
    assert calls == [qtype, down_t]  # one group, its products fanned out: gate+up, then down
    (want,) = _general(monkeypatch, [plan], views, ids, shared=False)
    _assert_same(got, want)


def test_gate_and_up_of_other_types_and_every_split(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    views = _views(8, Q.Q4_K, Q.Q8_0, rng, up_t=Q.Q5_K)
    plan, ids = _one_token(rng, 8, 8)
    (want,) = _general(monkeypatch, [plan], views, ids, shared=False)
    for threads in (1, 2, 3, 8):
        configure_compute_pool(threads)
        (got,) = expert_outputs([plan], views, ids, shared=False)
        _assert_same(got, want)


def test_a_non_finite_input_takes_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    views = _views(4, Q.Q4_K, Q.Q4_K, rng)
    x = rng.standard_normal((1, N_EMBD), dtype=np.float32)
    x[0, 5] = np.inf
    plan, ids = _one_token(rng, 4, 2, x)
    (got,) = expert_outputs([plan], views, ids, shared=False)
    (want,) = _general(monkeypatch, [plan], views, ids, shared=False)
    for e in ids:
        assert np.array_equal(got.rows[e], want.rows[e], equal_nan=True)
        assert not np.isfinite(got.rows[e]).all()


def test_what_groups_do_not_serve() -> None:
    rng = np.random.default_rng(5)
    views = list(_views(2, Q.Q4_K, Q.Q4_K, rng).values())
    assert decode_experts.group_classes(views) == [[0, 1]]
    padded = ExpertView(0, 9, 0, views[0].gate, views[0].up, _proj(Q.Q4_K, (N_EMBD, 2 * N_FF), rng))
    assert decode_experts.group_classes([padded]) is None
    f16 = ExpertView(0, 9, 0, *(_proj(Q.F16, p.shape, rng) for p in (views[0].gate, views[0].up, views[0].down)))
    assert decode_experts.group_classes([*views, f16]) is None  # no int8 kernel
    fused.set_precision("float")
    assert decode_experts.group_classes(views) is None
    assert decode_experts.group_classes([]) is None


def test_banks_and_tiers_of_one_layer_go_in_a_group_each(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(13)
    full = _views(8, Q.Q4_K, Q.Q4_K, rng)
    low = _views(8, Q.Q2_K, Q.Q2_K, rng)
    views = {e: (full[e] if e % 3 else ExpertView(0, e, 1, low[e].gate, low[e].up, low[e].down)) for e in range(8)}
    assert decode_experts.group_classes([views[e] for e in range(8)]) == [[0, 3, 6], [1, 2, 4, 5, 7]]
    plan, ids = _one_token(rng, 8, 8)
    calls = []
    real = grouped.matvec_group
    monkeypatch.setattr(decode_experts, "matvec_group", lambda *a: calls.append(a[0]) or real(*a))
    (got,) = expert_outputs([plan], views, ids, shared=False)
    assert sorted(calls) == sorted([Q.Q4_K, Q.Q4_K, Q.Q2_K, Q.Q2_K])  # one group per class: gate+up, down
    (want,) = _general(monkeypatch, [plan], views, ids, shared=False)
    _assert_same(got, want)


def test_matvec_group_checks_its_arguments() -> None:
    rng = np.random.default_rng(9)
    p = _proj(Q.Q8_0, (N_FF, N_EMBD), rng)
    x = rng.standard_normal((1, N_EMBD), dtype=np.float32)
    out = np.empty((1, N_FF), dtype=np.float32)
    rows0 = np.zeros(1, dtype=np.int64)
    assert grouped.matvec_group(Q.Q8_0, p.shape, [p], x, rows0, out)
    want = fused.linear(p.data, Q.Q8_0, p.shape, x)
    assert np.array_equal(out, want)
    short = memoryview(bytes(p.data)[: -GGML_QUANT_SIZES[Q.Q8_0][1]])
    with pytest.raises(FormatError, match="needs"):
        grouped.matvec_group(Q.Q8_0, p.shape, [ProjectionView(short, p.ggml_type, p.shape)], x, rows0, out)
    with pytest.raises(ConfigError):
        grouped.matvec_group(Q.Q8_0, p.shape, [p], x, np.ones(1, dtype=np.int64), out)  # row 1 of 1
    with pytest.raises(ConfigError):
        grouped.matvec_group(Q.Q8_0, p.shape, [p], x.astype(np.float64), rows0, out)
    with pytest.raises(ConfigError):
        grouped.matvec_group(Q.Q8_0, p.shape, [p, p], x, rows0, out)
    assert not grouped.matvec_group(Q.F16, p.shape, [p], x, rows0, out)  # no int8 kernel: not served


def test_the_group_activation_is_elementwise() -> None:
    rng = np.random.default_rng(11)
    g, u = rng.standard_normal((2, 5, 64), dtype=np.float32) * 4
    whole = np.empty_like(g)
    swiglu(g.copy(), u.copy(), np.empty_like(g), whole)
    for i in range(5):
        row = np.empty((1, 64), dtype=np.float32)
        swiglu(g[i : i + 1].copy(), u[i : i + 1].copy(), np.empty_like(row), row)
        assert np.array_equal(row, whole[i : i + 1])


def test_a_product_task_is_compiled_once_and_serves_only_int8_types() -> None:
    task = grouped.product_task(Q.Q4_0)
    assert task is not None and task.address
    again = grouped.product_task(Q.Q4_0)
    assert again is not None and again.address == task.address  # compiled once per kernel
    assert grouped.product_task(Q.F16) is None
    fused.set_precision("float")
    assert grouped.product_task(Q.Q4_0) is None


def test_a_views_address_is_its_own_and_replace_still_works() -> None:
    import dataclasses

    buf = np.arange(200, dtype=np.uint8)
    buf.flags.writeable = False
    view = ProjectionView(memoryview(buf)[10:110], Q.Q8_0, (1, 96))
    assert view.address == buf.ctypes.data + 10 == view.address  # found once, then kept
    moved = dataclasses.replace(view, data=memoryview(buf)[50:150])  # the public dataclass API
    assert moved.address == buf.ctypes.data + 50
    assert moved == ProjectionView(memoryview(buf)[50:150], Q.Q8_0, (1, 96))  # the address is not compared


def _combined_general(
    monkeypatch: pytest.MonkeyPatch, plan, views: dict[int, ExpertView], ids: list[int]
) -> np.ndarray:
    (found,) = _general(monkeypatch, [plan], views, ids, shared=False)
    return moe_module.combine_moe(plan, found).ffn_out


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_rows_prepared_step_gives_the_general_bits(
    qtype: Q, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    configure_compute_pool(threads)
    rng = np.random.default_rng(qtype.value + threads)
    views = _views(16, qtype, Q.Q6_K, rng)
    steps: moe_module.RowSteps = {}
    for _ in range(3):  # made on the first call, then reused with other experts and inputs
        plan, ids = _one_token(rng, 16, 8)
        got = moe_module.row_ffn_out(plan, [views[e] for e in ids], steps)
        assert got is not None and got.shape == (1, N_EMBD)
        assert np.array_equal(got, _combined_general(monkeypatch, plan, views, ids))
    assert isinstance(steps[0], decode_experts.RowStep)


def test_a_prepared_step_serves_only_what_it_was_made_for(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(11)
    views = _views(8, Q.Q4_K, Q.Q4_K, rng)
    other = _views(8, Q.Q8_0, Q.Q8_0, rng)
    steps: moe_module.RowSteps = {}
    plan, ids = _one_token(rng, 8, 4)
    assert moe_module.row_ffn_out(plan, [views[e] for e in ids], steps) is not None
    # another class of experts (a tier, a bank), a busy step: None, the caller takes the general path
    assert moe_module.row_ffn_out(plan, [other[e] for e in ids], steps) is None
    step = steps[0]
    assert step is not None
    with step._lock:
        assert moe_module.row_ffn_out(plan, [views[e] for e in ids], steps) is None
    # a non-finite input: None, nothing returned that may be used
    x = plan.x.copy()
    x[0, 3] = np.nan
    bad = moe_module.plan_moe(x, plan.ids, plan.weights, plan.resident, plan.hparams)
    assert moe_module.row_ffn_out(bad, [views[e] for e in ids], steps) is None
    # two tokens, a repeated expert: no step at all
    two = moe_module.plan_moe(
        np.vstack([x, x]), np.vstack([plan.ids, plan.ids]), np.vstack([plan.weights] * 2), plan.resident, plan.hparams
    )
    assert moe_module.row_ffn_out(two, [views[e] for e in ids], steps) is None
    # float precision: the layer gets no step
    fused.set_precision("float")
    assert moe_module.row_ffn_out(plan, [views[e] for e in ids], {}) is None


def test_a_view_that_does_not_fit_the_layer_is_refused_by_the_step() -> None:
    rng = np.random.default_rng(12)
    views = _views(4, Q.Q4_K, Q.Q4_K, rng)
    plan, ids = _one_token(rng, 4, 2)
    wide = ExpertView(0, ids[0], 0, views[0].gate, views[0].up, _proj(Q.Q4_K, (N_EMBD + 256, N_FF), rng))
    with pytest.raises(moe_module.InvalidRequestError, match="down"):
        moe_module.row_ffn_out(plan, [wide, views[ids[1]]], {})


def test_a_prepared_step_refuses_inputs_that_do_not_fit_it() -> None:
    rng = np.random.default_rng(14)
    views = _views(4, Q.Q8_0, Q.Q8_0, rng)
    plan, ids = _one_token(rng, 4, 4)
    steps: moe_module.RowSteps = {}
    assert moe_module.row_ffn_out(plan, [views[e] for e in ids], steps) is not None
    step = steps[0]
    assert step is not None
    chosen, w = [views[e] for e in ids], plan.weights[0]
    for bad_views, bad_w, bad_x in (
        (chosen[:3], w, plan.x),  # fewer experts than the step: the last slot's address would be stale
        (chosen, w[:3], plan.x),  # fewer weights: the compiled sum would read past them
        (chosen, w.astype(np.float64), plan.x),
        (chosen, w, np.vstack([plan.x, plan.x])),
    ):
        with pytest.raises(ConfigError, match="RowStep of 4 experts"):
            step.run(bad_x, bad_views, bad_w)
    with pytest.raises(ValueError, match="no views"):
        decode_experts.RowStep([], swiglu)


def _table(views: dict[int, ExpertView]) -> ExpertTable:
    order = [views[e] for e in sorted(views)]
    addresses = np.array(
        [[v.gate.address for v in order], [v.up.address for v in order], [v.down.address for v in order]]
    )
    return ExpertTable(np.ascontiguousarray(addresses, dtype=np.int64), layout_key(order[0]))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_step_run_from_a_table_gives_the_views_bits(qtype: Q, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    configure_compute_pool(threads)
    rng = np.random.default_rng(40 + qtype.value + threads)
    views = _views(16, qtype, Q.Q6_K, rng)
    table = _table(views)
    steps: moe_module.RowSteps = {}
    plan, ids = _one_token(rng, 16, 8)
    first = moe_module.row_ffn_out_at(plan, table, steps)  # no step yet: made from the table's layout
    assert first is not None and steps[0] is not None and steps[0].layout is table.layout
    assert np.array_equal(first, _combined_general(monkeypatch, plan, views, ids))
    assert np.array_equal(moe_module.row_ffn_out(plan, [views[e] for e in ids], steps), first)
    for _ in range(3):
        plan, ids = _one_token(rng, 16, 8)
        got = moe_module.row_ffn_out_at(plan, table, steps)
        assert got is not None
        assert np.array_equal(got, moe_module.row_ffn_out(plan, [views[e] for e in ids], steps))
        assert np.array_equal(got, _combined_general(monkeypatch, plan, views, ids))


def test_a_table_of_another_layout_or_bad_ids_is_not_used() -> None:
    rng = np.random.default_rng(41)
    views = _views(8, Q.Q4_K, Q.Q4_K, rng)
    other = _table(_views(8, Q.Q8_0, Q.Q8_0, rng))
    steps: moe_module.RowSteps = {}
    plan, ids = _one_token(rng, 8, 4)
    assert moe_module.row_ffn_out(plan, [views[e] for e in ids], steps) is not None
    assert moe_module.row_ffn_out_at(plan, other, steps) is None  # the step's kernels are not the table's
    step = steps[0]
    assert step is not None
    table = _table(views)
    with step._lock:  # busy: None, the caller goes on with views
        assert moe_module.row_ffn_out_at(plan, table, steps) is None
    short = ExpertTable(table.addresses[:, :6], table.layout)
    before = step._gate_up.addresses.copy(), step._down.addresses.copy()
    for bad_ids in ([0, 1, 2, 6], [0, 1, 2, -1], [6, 0, 1, 2]):
        with pytest.raises(ConfigError, match="outside the table"):
            step.run_at(plan.x, np.array(bad_ids, dtype=np.int64), short.addresses, plan.weights[0])
        # nothing written: no address of a good id before the bad one either
        assert np.array_equal(step._gate_up.addresses, before[0]) and np.array_equal(step._down.addresses, before[1])
    ids64 = np.array(ids, dtype=np.int64)
    for bad in (
        (plan.x, ids64[:3], table.addresses, plan.weights[0]),
        (plan.x, ids64.astype(np.int32), table.addresses, plan.weights[0]),
        (plan.x, ids64, table.addresses[:2], plan.weights[0]),
        (plan.x, ids64, table.addresses.astype(np.float64), plan.weights[0]),
        (plan.x, ids64, table.addresses, plan.weights[0][:3]),
        (np.vstack([plan.x, plan.x]), ids64, table.addresses, plan.weights[0]),
    ):
        with pytest.raises(ConfigError, match="RowStep of 4 experts"):
            step.run_at(*bad)


def test_a_table_whose_layout_does_not_fit_the_layer_makes_no_step() -> None:
    """A table's layout whose shapes the layer does not have (or without a group kernel) makes no
    step and keeps none: the views path then decides (and raises for a view that does not fit)."""
    rng = np.random.default_rng(42)
    views = _views(8, Q.Q4_K, Q.Q4_K, rng)
    plan, _ = _one_token(rng, 8, 4)
    table = _table(views)
    (types, (gate, up, down), n_bytes) = table.layout
    for bad in (
        (types, ((gate[0], gate[1] + 32), (up[0], up[1] + 32), down), n_bytes),  # not n_embd wide
        (types, (gate, up, (down[0], gate[0] - 32)), n_bytes),  # a down narrower than the gate
        ((types[0], Q.Q8_0, types[2]), (gate, up, down), n_bytes),  # gate and up of two types
    ):
        steps: moe_module.RowSteps = {}
        assert moe_module.row_ffn_out_at(plan, ExpertTable(table.addresses, bad), steps) is None
        assert steps == {}
