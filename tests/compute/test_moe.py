"""The MoE executor: llama.cpp goldens for every fixture, then synthetic unit cases."""

from __future__ import annotations

import threading
from pathlib import Path

import fixture_views as fv
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from aioexperts._compute import fused
from aioexperts._compute.moe import MoEOutput, ResidentLayer, moe_forward, route, router_logits
from aioexperts._errors import ConfigError, InvalidRequestError
from aioexperts._format import dequant as quant
from aioexperts._format.hparams import Activation, GatingFunc, MoEHParams
from aioexperts._format.views import ExpertView, ProjectionView

F32 = GGMLQuantizationType.F32


def rel_l2(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual.astype(np.float64) - expected) / np.linalg.norm(expected))


# --------------------------------------------------------------------------------------------------
# llama.cpp goldens


def _tolerance(path: Path) -> float:
    name = path.stem
    if name.endswith("-f32"):
        return 1e-5
    return 2e-6  # quantized and mixed-tier files: llama.cpp's rounding of the activations, reproduced


def _golden_cases() -> list:
    cases = []
    for path in fv.fixture_paths():
        gold = fv.golden(path)
        layers = sorted(int(k.split("-")[-1]) for k in gold if k.startswith("moe_out-"))
        cases += [pytest.param(path, layer, id=f"{path.stem}-L{layer}") for layer in layers]
    return cases


GOLDEN_CASES = _golden_cases()

_lock = threading.Lock()


def _hparams(path: Path) -> MoEHParams:
    md = fv.metadata(path)
    return MoEHParams.from_metadata(str(md["general.architecture"]), md)


@pytest.mark.skipif(not GOLDEN_CASES, reason="shared fixtures not found")
@pytest.mark.parametrize(("path", "layer"), GOLDEN_CASES)
def test_matches_llama_cpp_golden(path: Path, layer: int, record_property) -> None:
    hp = _hparams(path)
    gold = fv.golden(path)
    x = np.atleast_2d(gold[f"moe_in-{layer}"])
    n_tokens = x.shape[0]

    resident = ResidentLayer.from_tensors(layer, fv.tensor_getter(path), hp, tensor_type=fv.type_getter(path))

    logits = router_logits(x, resident)
    expected_logits = np.atleast_2d(gold[f"router_logits-{layer}"])
    if resident.router_bias is not None:  # gpt-oss: the golden's router_logits has no bias (fixtures README)
        expected_logits = expected_logits + resident.router_bias
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=2e-5)

    ids, weights = route(x, resident, hp)
    assert ids.dtype == np.int32
    assert weights.dtype == np.float32
    np.testing.assert_array_equal(ids, np.atleast_2d(gold[f"topk-{layer}"]))
    np.testing.assert_allclose(weights, np.atleast_2d(gold[f"weights-{layer}"]), rtol=1e-5, atol=2e-6)

    views = fv.expert_views(path, layer)
    out = moe_forward(x, ids, weights, views, resident, hp, expert_out=True)
    assert isinstance(out, MoEOutput)

    tol = _tolerance(path)
    errors = {"moe_out": rel_l2(out.moe_out, np.atleast_2d(gold[f"moe_out-{layer}"]))}
    if f"shared_out-{layer}" in gold:
        assert out.shared_out is not None
        errors["shared_out"] = rel_l2(out.shared_out, np.atleast_2d(gold[f"shared_out-{layer}"]))
        errors["ffn_out"] = rel_l2(out.ffn_out, np.atleast_2d(gold[f"ffn_out-{layer}"]))
    else:
        assert out.shared_out is None
        assert out.ffn_out is out.moe_out
    if f"expert_out-{layer}" in gold:
        expected = gold[f"expert_out-{layer}"].reshape(n_tokens, hp.n_expert_used, hp.n_embd)
        errors["expert_out"] = rel_l2(out.expert_out, expected)

    with _lock:
        print(f"\n{path.stem} L{layer}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    for key, err in errors.items():
        record_property(f"rel_l2_{key}", err)
        assert err <= tol, f"{key}: relative L2 {err:.3e} > {tol:.0e}"


@pytest.mark.skipif(not GOLDEN_CASES, reason="shared fixtures not found")
def test_dense_leading_layer_is_refused() -> None:
    path = next((p for p in fv.fixture_paths() if p.stem.startswith("glm4moe")), None)
    if path is None:
        pytest.skip("no glm4moe fixture")
    hp = _hparams(path)
    assert hp.n_layer_dense_lead == 1
    with pytest.raises(ConfigError, match="no routed experts"):
        ResidentLayer.from_tensors(0, fv.tensor_getter(path), hp)


@pytest.mark.skipif(not GOLDEN_CASES, reason="shared fixtures not found")
def test_mixed_tier_views_carry_their_bank_types() -> None:
    path = next((p for p in fv.fixture_paths() if p.stem.endswith("-mixed")), None)
    if path is None:
        pytest.skip("no mixed-tier fixture")
    views = fv.expert_views(path, 0)
    banks = {e: (v.bank, v.gate.ggml_type.name, v.down.ggml_type.name) for e, v in views.items()}
    assert banks[0] == (0, "Q8_0", "Q8_0")
    assert banks[3][0] == 1
    assert banks[3][1] == "Q4_K"
    assert banks[5][0] == 2
    assert banks[5][1] == "Q2_K"
    assert banks[5][2] == "Q3_K"
    assert banks[7] == (3, "IQ4_XS", "IQ4_XS")


# --------------------------------------------------------------------------------------------------
# synthetic experts


def _hp(**kw) -> MoEHParams:
    base = {"arch": "test", "n_layer": 1, "n_embd": 32, "n_expert": 4, "n_expert_used": 2, "n_ff_exp": 16}
    base.update(kw)
    return MoEHParams(**base)


def _proj(w: np.ndarray, qtype: GGMLQuantizationType = F32) -> ProjectionView:
    if qtype == GGMLQuantizationType.F16:
        raw = w.astype(np.float16).tobytes()
    else:
        raw = np.ascontiguousarray(w, dtype=np.float32).tobytes()
    return ProjectionView(memoryview(raw).toreadonly(), qtype, w.shape)


class Bank:
    """Random float32 experts, with their views and a float64 reference forward pass."""

    def __init__(self, rng, n_expert, n_embd, n_ff, n_ff_down=None, scale=0.3, types=None):
        n_ff_down = n_ff_down or n_ff
        self.gate = rng.standard_normal((n_expert, n_ff, n_embd), dtype=np.float32) * scale
        self.up = rng.standard_normal((n_expert, n_ff, n_embd), dtype=np.float32) * scale
        self.down = rng.standard_normal((n_expert, n_embd, n_ff_down), dtype=np.float32) * scale
        types = types or [F32] * n_expert
        if any(t == GGMLQuantizationType.F16 for t in types):  # the reference sees the rounded values
            for e, t in enumerate(types):
                if t == GGMLQuantizationType.F16:
                    for w in (self.gate, self.up, self.down):
                        w[e] = w[e].astype(np.float16).astype(np.float32)
        self.views = {
            e: ExpertView(
                layer=0,
                expert=e,
                bank=0,
                gate=_proj(self.gate[e], types[e]),
                up=_proj(self.up[e], types[e]),
                down=_proj(self.down[e], types[e]),
            )
            for e in range(n_expert)
        }

    def reference(self, x, ids, weights, resident=None, act="silu", alpha=1.702, limit=7.0):
        x = x.astype(np.float64)
        n_ff = self.gate.shape[1]
        out = np.zeros((x.shape[0], ids.shape[1], x.shape[1]))
        for t in range(x.shape[0]):
            for i, e in enumerate(ids[t]):
                if e < 0:
                    continue
                g = self.gate[e].astype(np.float64) @ x[t]
                u = self.up[e].astype(np.float64) @ x[t]
                if resident is not None and resident.gate_exps_bias is not None:
                    g += resident.gate_exps_bias[e]
                    u += resident.up_exps_bias[e]
                if act == "silu":
                    a = g / (1 + np.exp(-g)) * u
                else:
                    g = np.minimum(g, limit)
                    u = np.clip(u, -limit, limit)
                    a = g / (1 + np.exp(-alpha * g)) * (u + 1)
                padded = np.zeros(self.down.shape[2])
                padded[:n_ff] = a
                y = self.down[e].astype(np.float64) @ padded
                if resident is not None and resident.down_exps_bias is not None:
                    y += resident.down_exps_bias[e]
                out[t, i] = y
        moe = (out * np.where(ids >= 0, weights, 0)[:, :, None]).sum(axis=1)
        return moe, out


def _resident(rng, n_expert=4, n_embd=32, **kw) -> ResidentLayer:
    router = rng.standard_normal((n_expert, n_embd), dtype=np.float32)
    return ResidentLayer(layer=0, router=router, **kw)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_routed_experts_match_reference(rng) -> None:
    hp = _hp()
    bank = Bank(rng, 4, 32, 16)
    res = _resident(rng)
    x = rng.standard_normal((9, 32), dtype=np.float32)
    ids, weights = route(x, res, hp)
    out = moe_forward(x, ids, weights, bank.views, res, hp)
    moe, _ = bank.reference(x, ids, weights)
    assert rel_l2(out.moe_out, moe) < 1e-6
    assert out.expert_out is None  # off by default
    assert out.shared_out is None
    assert out.ffn_out is out.moe_out


def test_expert_out_and_slot_order(rng) -> None:
    hp = _hp()
    bank = Bank(rng, 4, 32, 16)
    res = _resident(rng)
    x = rng.standard_normal((5, 32), dtype=np.float32)
    ids = np.array([[3, 0], [0, 3], [1, 2], [2, 2], [0, 1]], dtype=np.int32)
    weights = rng.random((5, 2), dtype=np.float32)
    out = moe_forward(x, ids, weights, bank.views, res, hp, expert_out=True)
    moe, per_slot = bank.reference(x, ids, weights)
    assert out.expert_out.shape == (5, 2, 32)
    assert rel_l2(out.expert_out, per_slot) < 1e-6
    # token 3 picked expert 2 twice: both slots count (llama.cpp computes each slot)
    assert rel_l2(out.moe_out, moe) < 1e-6


def test_swiglu_oai_clamps(rng) -> None:
    hp = _hp(activation=Activation.SWIGLU_OAI, gating_func=GatingFunc.SOFTMAX_WEIGHT)
    bank = Bank(rng, 4, 32, 16, scale=1.5)  # large pre-activations: both clamps engage
    res = _resident(rng)
    x = rng.standard_normal((6, 32), dtype=np.float32) * 2
    ids, weights = route(x, res, hp)
    out = moe_forward(x, ids, weights, bank.views, res, hp, expert_out=True)
    g = np.einsum("fe,te->tf", bank.gate[ids[0, 0]], x[:1])
    assert g.max() > 7.0
    assert g.min() < -7.0
    moe, per_slot = bank.reference(x, ids, weights, act="oai")
    assert rel_l2(out.expert_out, per_slot) < 1e-6
    assert rel_l2(out.moe_out, moe) < 1e-6
    # and it is not plain SwiGLU
    plain, _ = bank.reference(x, ids, weights, act="silu")
    assert rel_l2(out.moe_out, plain) > 1e-2


def test_swiglu_oai_formula_on_one_value() -> None:
    """One expert with n_embd = n_ff = 1 reproduces ggml_swiglu_oai on chosen values."""
    hp = MoEHParams(
        arch="t",
        n_layer=1,
        n_embd=32,
        n_expert=1,
        n_expert_used=1,
        n_ff_exp=32,
        activation=Activation.SWIGLU_OAI,
    )
    # identity gate/up/down: g = u = x, so the output is act(x, x) element-wise
    eye = np.eye(32, dtype=np.float32)
    view = ExpertView(0, 0, 0, _proj(eye), _proj(eye), _proj(eye))
    res = ResidentLayer(0, router=np.ones((1, 32), dtype=np.float32))
    x = np.linspace(-10, 10, 32, dtype=np.float32)[None, :]
    out = moe_forward(x, np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), {0: view}, res, hp)
    g = np.minimum(x.astype(np.float64), 7.0)
    u = np.clip(x.astype(np.float64), -7.0, 7.0)
    expected = g / (1 + np.exp(-1.702 * g)) * (u + 1)
    np.testing.assert_allclose(out.moe_out, expected, rtol=1e-6, atol=1e-6)


def test_expert_biases(rng) -> None:
    hp = _hp(activation=Activation.SWIGLU_OAI, gating_func=GatingFunc.SOFTMAX_WEIGHT)
    bank = Bank(rng, 4, 32, 16)
    res = _resident(
        rng,
        router_bias=rng.standard_normal(4, dtype=np.float32),
        gate_exps_bias=rng.standard_normal((4, 16), dtype=np.float32),
        up_exps_bias=rng.standard_normal((4, 16), dtype=np.float32),
        down_exps_bias=rng.standard_normal((4, 32), dtype=np.float32),
    )
    x = rng.standard_normal((7, 32), dtype=np.float32)
    logits = router_logits(x, res)
    np.testing.assert_allclose(logits, x @ res.router.T + res.router_bias, rtol=1e-6, atol=1e-6)
    ids, weights = route(x, res, hp)
    out = moe_forward(x, ids, weights, bank.views, res, hp, expert_out=True)
    moe, per_slot = bank.reference(x, ids, weights, resident=res, act="oai")
    assert rel_l2(out.expert_out, per_slot) < 1e-6
    assert rel_l2(out.moe_out, moe) < 1e-6
    no_bias, _ = bank.reference(x, ids, weights, act="oai")
    assert rel_l2(out.moe_out, no_bias) > 1e-2


def test_down_width_zero_padding(rng) -> None:
    """n_ff_down > n_ff: the activation is zero-padded, so the extra down columns never count."""
    hp = _hp()
    bank = Bank(rng, 4, 32, 16, n_ff_down=24)
    assert np.abs(bank.down[:, :, 16:]).min() > 0  # the padding columns hold real numbers
    res = _resident(rng)
    x = rng.standard_normal((6, 32), dtype=np.float32)
    ids, weights = route(x, res, hp)
    out = moe_forward(x, ids, weights, bank.views, res, hp)
    moe, _ = bank.reference(x, ids, weights)
    assert rel_l2(out.moe_out, moe) < 1e-6
    # same as an expert whose down projection is cut to n_ff
    cut = {
        e: ExpertView(0, e, 0, v.gate, v.up, _proj(np.ascontiguousarray(bank.down[e][:, :16])))
        for e, v in bank.views.items()
    }
    out_cut = moe_forward(x, ids, weights, cut, res, hp)
    np.testing.assert_allclose(out.moe_out, out_cut.moe_out, rtol=1e-5, atol=1e-6)


def test_mixed_types_in_one_call(rng) -> None:
    fused.set_precision("float")  # against a float64 reference of the float32 activations
    try:
        _mixed_types_in_one_call(rng)
    finally:
        fused.set_precision(None)


def _mixed_types_in_one_call(rng) -> None:
    hp = _hp()
    types = [F32, GGMLQuantizationType.F16, F32, GGMLQuantizationType.F16]
    bank = Bank(rng, 4, 32, 16, types=types)
    res = _resident(rng)
    x = rng.standard_normal((8, 32), dtype=np.float32)
    ids, weights = route(x, res, hp)
    assert {bank.views[e].gate.ggml_type for e in np.unique(ids)} == set(types)
    out = moe_forward(x, ids, weights, bank.views, res, hp)
    moe, _ = bank.reference(x, ids, weights)
    assert rel_l2(out.moe_out, moe) < 1e-6


def test_inactive_slots(rng) -> None:
    hp = _hp()
    bank = Bank(rng, 4, 32, 16)
    res = _resident(rng)
    x = rng.standard_normal((4, 32), dtype=np.float32)
    ids = np.array([[1, -1], [-1, -1], [2, 0], [-1, 3]], dtype=np.int32)
    weights = np.array([[0.7, np.nan], [np.inf, 1.0], [0.5, 0.5], [9.0, 0.25]], dtype=np.float32)
    views = {e: bank.views[e] for e in (0, 1, 2, 3)}
    out = moe_forward(x, ids, weights, views, res, hp, expert_out=True)
    assert np.isfinite(out.moe_out).all()  # the weight of an inactive slot never counts
    np.testing.assert_array_equal(out.moe_out[1], 0.0)
    np.testing.assert_array_equal(out.expert_out[ids < 0], 0.0)
    moe, _ = bank.reference(x, ids, np.nan_to_num(weights))
    assert rel_l2(out.moe_out, moe) < 1e-6


def test_all_inactive_needs_no_views(rng, monkeypatch) -> None:
    hp = _hp()
    res = _resident(rng)
    calls = []
    monkeypatch.setattr(quant, "dequantize", lambda *a: calls.append(a))
    monkeypatch.setattr(fused, "linear", lambda *a, **kw: calls.append(a))
    x = rng.standard_normal((3, 32), dtype=np.float32)
    ids = np.full((3, 2), -1, dtype=np.int32)
    out = moe_forward(x, ids, np.ones((3, 2), np.float32), {}, res, hp)
    np.testing.assert_array_equal(out.moe_out, 0.0)
    assert calls == []


def test_missing_expert_view(rng) -> None:
    hp = _hp()
    bank = Bank(rng, 4, 32, 16)
    res = _resident(rng)
    x = rng.standard_normal((2, 32), dtype=np.float32)
    ids = np.array([[0, 3], [1, 3]], dtype=np.int32)
    views = {0: bank.views[0], 1: bank.views[1]}
    with pytest.raises(InvalidRequestError, match=r"no expert view for selected expert\(s\) \[3\]"):
        moe_forward(x, ids, np.ones((2, 2), np.float32), views, res, hp)


def test_prefill_dequantizes_each_expert_once(rng, monkeypatch) -> None:
    hp = _hp(n_expert=8, n_expert_used=3)
    bank = Bank(rng, 8, 32, 16)
    res = _resident(rng, n_expert=8)
    calls: list[tuple[int, str]] = []
    real = fused.linear
    by_buffer = {id(getattr(v, p).data): (e, p) for e, v in bank.views.items() for p in ("gate", "up", "down")}

    def counting(data, ggml_type, shape, x, *, out=None):
        if id(data) in by_buffer:  # routers and shared experts are resident arrays
            calls.append(by_buffer[id(data)])
        return real(data, ggml_type, shape, x, out=out)

    # one kernel call per projection of each distinct expert: it decodes every row once
    monkeypatch.setattr(fused, "linear", counting)
    x = rng.standard_normal((64, 32), dtype=np.float32)
    ids, weights = route(x, res, hp)
    used = np.unique(ids)
    assert len(used) >= 6  # many tokens share experts
    out = moe_forward(x, ids, weights, bank.views, res, hp)
    assert len(calls) == 3 * len(used)
    assert sorted(calls) == sorted((int(e), p) for e in used for p in ("gate", "up", "down"))
    # one token at a time gives the same result (batching changes only the float summation order)
    calls.clear()
    single = np.concatenate(
        [moe_forward(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], bank.views, res, hp).moe_out for t in range(8)]
    )
    np.testing.assert_allclose(out.moe_out[:8], single, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    n_tokens=st.integers(1, 12),
    k=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    inactive=st.floats(0.0, 0.6),
)
def test_random_routing_matches_reference(n_tokens, k, seed, inactive) -> None:
    rng = np.random.default_rng(seed)
    hp = _hp(n_expert=6, n_expert_used=k)
    bank = Bank(rng, 6, 32, 16)
    res = _resident(rng, n_expert=6)
    x = rng.standard_normal((n_tokens, 32), dtype=np.float32)
    ids = rng.integers(0, 6, size=(n_tokens, k)).astype(np.int32)  # duplicates allowed
    ids[rng.random((n_tokens, k)) < inactive] = -1
    weights = rng.random((n_tokens, k), dtype=np.float32)
    out = moe_forward(x, ids, weights, bank.views, res, hp, expert_out=True)
    moe, per_slot = bank.reference(x, ids, weights)
    np.testing.assert_allclose(out.moe_out, moe, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out.expert_out, per_slot, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# shared expert


def _shared_weights(rng, n_embd=32, n_ff=24):
    return {
        "shexp_gate": rng.standard_normal((n_ff, n_embd), dtype=np.float32) * 0.3,
        "shexp_up": rng.standard_normal((n_ff, n_embd), dtype=np.float32) * 0.3,
        "shexp_down": rng.standard_normal((n_embd, n_ff), dtype=np.float32) * 0.3,
    }


def _shared_reference(x, w, gate_inp=None):
    x = x.astype(np.float64)
    g = x @ w["shexp_gate"].T.astype(np.float64)
    u = x @ w["shexp_up"].T.astype(np.float64)
    out = (g / (1 + np.exp(-g)) * u) @ w["shexp_down"].T.astype(np.float64)
    if gate_inp is not None:
        out *= (1 / (1 + np.exp(-(x @ gate_inp.astype(np.float64)))))[:, None]
    return out


def test_shared_expert_ungated_and_scale_on_routed_only(rng) -> None:
    """GLM-4.5 / DeepSeek style: the weights scale touches the routed part only."""
    bank = Bank(rng, 4, 32, 16)
    sh = _shared_weights(rng)
    res = _resident(rng, **sh)
    x = rng.standard_normal((5, 32), dtype=np.float32)
    hp1 = _hp(gating_func=GatingFunc.SIGMOID, weights_norm=True, weights_scale=1.0, n_expert_shared=1)
    hp2 = _hp(gating_func=GatingFunc.SIGMOID, weights_norm=True, weights_scale=2.5, n_expert_shared=1)
    ids1, w1 = route(x, res, hp1)
    ids2, w2 = route(x, res, hp2)
    np.testing.assert_array_equal(ids1, ids2)
    np.testing.assert_allclose(w2, 2.5 * w1, rtol=1e-6)
    o1 = moe_forward(x, ids1, w1, bank.views, res, hp1)
    o2 = moe_forward(x, ids2, w2, bank.views, res, hp2)
    assert rel_l2(o1.shared_out, _shared_reference(x, sh)) < 1e-6
    np.testing.assert_array_equal(o1.shared_out, o2.shared_out)
    np.testing.assert_allclose(o2.moe_out, 2.5 * o1.moe_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(o2.ffn_out, o2.moe_out + o2.shared_out, rtol=1e-6)


def test_shared_expert_sigmoid_gate(rng) -> None:
    """Qwen2-MoE: the shared output is multiplied by sigmoid(x . ffn_gate_inp_shexp)."""
    bank = Bank(rng, 4, 32, 16)
    sh = _shared_weights(rng)
    gate_inp = rng.standard_normal(32, dtype=np.float32)
    res = _resident(rng, shexp_gate_inp=gate_inp, **sh)
    hp = _hp(n_expert_shared=1)
    x = rng.standard_normal((5, 32), dtype=np.float32)
    x[0] -= gate_inp * (x[0] @ gate_inp) / (gate_inp @ gate_inp)  # x . w == 0: gate 0.5, no 0/0
    ids, weights = route(x, res, hp)
    out = moe_forward(x, ids, weights, bank.views, res, hp)
    expected = _shared_reference(x, sh, gate_inp)
    assert np.isfinite(out.shared_out).all()
    assert rel_l2(out.shared_out, expected) < 1e-5
    ungated = _shared_reference(x[:1], sh)
    np.testing.assert_allclose(out.shared_out[0], 0.5 * ungated[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out.ffn_out, out.moe_out + out.shared_out, rtol=1e-6)


def test_shared_gate_accepts_ggml_column_shape(rng) -> None:
    sh = _shared_weights(rng)
    res = _resident(rng, shexp_gate_inp=rng.standard_normal((1, 32), dtype=np.float32), **sh)
    assert res.shexp_gate_inp.shape == (32,)


# --------------------------------------------------------------------------------------------------
# resident weights and input checks


def test_from_tensors_reads_the_formats_names(rng) -> None:
    hp = _hp(n_layer=3, n_layer_dense_lead=1, n_expert_shared=1)
    tensors = {
        "blk.2.ffn_gate_inp.weight": rng.standard_normal((4, 32), dtype=np.float32),
        "blk.2.ffn_gate_inp.bias": rng.standard_normal(4, dtype=np.float32),
        "blk.2.exp_probs_b.bias": rng.standard_normal(4, dtype=np.float32),
        "blk.2.ffn_gate_up_exps.bias": rng.standard_normal((4, 32), dtype=np.float32),
        "blk.2.ffn_down_exps.bias": rng.standard_normal((4, 32), dtype=np.float32),
        "blk.2.ffn_gate_shexp.weight": rng.standard_normal((24, 32), dtype=np.float32),
        "blk.2.ffn_up_shexp.weight": rng.standard_normal((24, 32), dtype=np.float32),
        "blk.2.ffn_down_shexp.weight": rng.standard_normal((32, 24), dtype=np.float32),
        "blk.2.ffn_gate_inp_shexp.weight": rng.standard_normal(32, dtype=np.float32),
    }
    res = ResidentLayer.from_tensors(2, tensors.get, hp)
    assert res.layer == 2
    assert res.n_layer_experts == 4
    assert res.n_embd == 32
    assert res.has_shared
    np.testing.assert_array_equal(res.gate_exps_bias, tensors["blk.2.ffn_gate_up_exps.bias"][:, :16])
    np.testing.assert_array_equal(res.up_exps_bias, tensors["blk.2.ffn_gate_up_exps.bias"][:, 16:])
    np.testing.assert_array_equal(res.selection_bias, tensors["blk.2.exp_probs_b.bias"])
    with pytest.raises(ConfigError, match="no routed experts"):
        ResidentLayer.from_tensors(0, tensors.get, hp)
    with pytest.raises(ConfigError, match="missing router"):
        ResidentLayer.from_tensors(1, tensors.get, hp)


def test_from_tensors_concatenates_tier_biases(rng) -> None:
    hp = _hp(n_expert=6)
    parts = [rng.standard_normal((n, 32), dtype=np.float32) for n in (3, 2, 1)]
    tensors = {"blk.0.ffn_gate_inp.weight": rng.standard_normal((6, 32), dtype=np.float32)}
    for i, part in enumerate(parts):
        suffix = "" if i == 0 else f"_tier{i}"
        tensors[f"blk.0.ffn_down_exps{suffix}.bias"] = part
    res = ResidentLayer.from_tensors(0, tensors.get, hp)
    np.testing.assert_array_equal(res.down_exps_bias, np.concatenate(parts))


def test_resident_rejects_bad_tensors(rng) -> None:
    router = rng.standard_normal((4, 32), dtype=np.float32)
    with pytest.raises(ConfigError, match="float32"):
        ResidentLayer(0, router=router.astype(np.float64))
    with pytest.raises(ConfigError, match=r"router_bias must be a float32 array of shape \(4,\)"):
        ResidentLayer(0, router=router, router_bias=np.zeros(5, np.float32))
    with pytest.raises(ConfigError, match="gate, up and down"):
        ResidentLayer(0, router=router, shexp_gate=np.zeros((8, 32), np.float32))
    with pytest.raises(ConfigError, match=r"shexp_down has shape \(32, 9\), expected \(32, 8\)"):
        ResidentLayer(
            0,
            router=router,
            shexp_gate=np.zeros((8, 32), np.float32),
            shexp_up=np.zeros((8, 32), np.float32),
            shexp_down=np.zeros((32, 9), np.float32),
        )


def test_input_checks(rng) -> None:
    hp = _hp()
    bank = Bank(rng, 4, 32, 16)
    res = _resident(rng)
    x = rng.standard_normal((3, 32), dtype=np.float32)
    ids = np.array([[0, 1], [1, 2], [2, 3]], dtype=np.int32)
    w = np.ones((3, 2), np.float32)
    with pytest.raises(InvalidRequestError, match=r"float32 array of shape \(n_tokens, 32\), got float64"):
        moe_forward(x.astype(np.float64), ids, w, bank.views, res, hp)
    with pytest.raises(InvalidRequestError, match=r"got float32 array of shape \(3, 31\)"):
        moe_forward(x[:, :31], ids, w, bank.views, res, hp)
    with pytest.raises(InvalidRequestError, match=r"ids must be an integer array of shape \(3, k\)"):
        moe_forward(x, ids[:2], w, bank.views, res, hp)
    with pytest.raises(InvalidRequestError, match="weights must be a float32 array"):
        moe_forward(x, ids, w.astype(np.float64), bank.views, res, hp)
    with pytest.raises(InvalidRequestError, match=r"in -1\.\.3 .*got 1\.\.4"):
        moe_forward(x, ids + 1, w, bank.views, res, hp)
    with pytest.raises(InvalidRequestError, match="got -2"):
        moe_forward(x, ids - 2, w, bank.views, res, hp)
    swapped = {0: bank.views[1], 1: bank.views[1], 2: bank.views[2], 3: bank.views[3]}
    with pytest.raises(InvalidRequestError, match="view given for expert 0 of layer 0 is expert 1"):
        moe_forward(x, ids, w, swapped, res, hp)
    with pytest.raises(InvalidRequestError, match="n_ff_exp is 8"):
        moe_forward(x, ids, w, bank.views, res, _hp(n_ff_exp=8))
    with pytest.raises(ConfigError, match="n_embd=32, hparams n_embd=16"):
        moe_forward(x, ids, w, bank.views, res, _hp(n_embd=16))
    with pytest.raises(InvalidRequestError, match="float32"):
        route(x.astype(np.float16), res, hp)


def test_bad_view_shapes(rng) -> None:
    hp = _hp()
    bank = Bank(rng, 4, 32, 16)
    res = _resident(rng)
    x = rng.standard_normal((1, 32), dtype=np.float32)
    v = bank.views[0]
    narrow_down = ExpertView(0, 0, 0, v.gate, v.up, _proj(np.zeros((32, 8), np.float32)))
    msg = r"down is \(32, 8\), expected \(n_embd=32, n_ff_down >= 16\)"
    with pytest.raises(InvalidRequestError, match=msg):
        moe_forward(x, np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), {0: narrow_down}, res, hp)
    odd_up = ExpertView(0, 0, 0, v.gate, _proj(np.zeros((8, 32), np.float32)), v.down)
    with pytest.raises(InvalidRequestError, match="gate .* and up .* must both be"):
        moe_forward(x, np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), {0: odd_up}, res, hp)


def test_empty_batch(rng) -> None:
    hp = _hp()
    res = _resident(rng)
    x = np.zeros((0, 32), np.float32)
    ids, w = route(x, res, hp)
    assert ids.shape == (0, 2)
    assert w.shape == (0, 2)
    out = moe_forward(x, ids, w, {}, res, hp, expert_out=True)
    assert out.moe_out.shape == (0, 32)
    assert out.expert_out.shape == (0, 2, 32)
