"""MLA attention (deepseek2) against llama.cpp's own tensors and an independent float64 reference.

The fixture ``more-archs/deepseek2-*.forward.npz`` holds, per layer, the attention input after its
RMSNorm (``attn_norm-L``) and the residual before and after the attention (``l_out-(L-1)`` or the
token embeddings, ``ffn_inp-L``): their difference is llama.cpp's attention block output, so the
attention is checked on its own. llama.cpp ran with its defaults, an F16 KV cache and CPU flash
attention; ``test_forward_llama_cpp._llama_cpp_f16_attention`` transcribes that arithmetic (ggml-cpu
ops.cpp ``ggml_compute_forward_flash_attn_ext_f16_one_chunk``) and, swapped in for the float32 softmax,
brings the MLA block within 1e-4 of llama.cpp on the F32 file. The package's float32 attention is
checked against the float64 reference (1e-5) and is within 1e-3 of llama.cpp (the F16 rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import shared_fixtures_dir
from gguf import GGMLQuantizationType, GGUFReader
from test_forward_llama_cpp import _llama_cpp_f16_attention

from aioexperts._compute import mla
from aioexperts._compute.rope import apply_rope, rope_cos_sin
from aioexperts._errors import ConfigError, FormatError, UnsupportedTypeError
from aioexperts._format.architectures import RopeParams, RopeType
from aioexperts._format.mla import MLAHParams

FILES = ("deepseek2-f32", "deepseek2-q4_k_m")
BOUND_LLAMA = {"deepseek2-f32": 1e-4, "deepseek2-q4_k_m": 8e-2}
N_LAYER, N_CTX = 3, 64


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _fixture(name: str) -> Path:
    root = shared_fixtures_dir()
    path = None if root is None else root / "more-archs" / f"{name}.gguf"
    if path is None or not path.exists():
        pytest.skip(f"shared fixture {name}.gguf not found")
    return path


def _tensor_getter(path: Path) -> Callable[[str], np.ndarray | None]:
    """``name -> float32 array (numpy order) | None``, dequantized by ``gguf.quants`` (independent of aioexperts)."""
    by_name = {t.name: t for t in GGUFReader(path).tensors}

    def get(name: str) -> np.ndarray | None:
        t = by_name.get(name)
        if t is None:
            return None
        shape = tuple(int(d) for d in reversed(t.shape))
        values = gguf.quants.dequantize(np.asarray(t.data), GGMLQuantizationType(t.tensor_type))
        return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)

    return get


def _metadata(path: Path) -> dict[str, object]:
    return {k: f.contents() for k, f in GGUFReader(path).fields.items()}


def _rope_norm(freq_base: float) -> mla.Rope:
    """The model's NORM-paired RoPE (aioexperts._compute.rope) without scaling."""

    def rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        params = RopeParams(RopeType.NORM, x.shape[-1], freq_base=freq_base)
        cos, sin = rope_cos_sin(params, pos)
        return apply_rope(x, cos, sin, RopeType.NORM, x.shape[-1])

    return rope


def _llama_cpp_flash_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float, **_: object
) -> np.ndarray:
    """``attend`` as llama.cpp's CPU run computes it (F16 cache, one-chunk flash attention), for a prefill."""
    assert start == 0
    return _llama_cpp_f16_attention(q, k, v, scale)


def _reference_rope(x: np.ndarray, pos: np.ndarray, freq_base: float) -> np.ndarray:
    # ggml ops.cpp rope_yarn without scaling: theta_i = pos * base^(-2i/n), pairs (2i, 2i+1) (NORM)
    n = x.shape[-1]
    theta = np.asarray(pos, np.float64)[:, None] * freq_base ** (-2.0 * np.arange(n // 2) / n)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out


def _reference_attention(x: np.ndarray, get: Callable[[str], np.ndarray | None], layer: int, md: dict) -> np.ndarray:
    """float64 transcription of deepseek2.cpp's MLA branch, written from the source, not from aioexperts."""
    a = "deepseek2."
    n_head, eps = int(md[a + "attention.head_count"]), float(md[a + "attention.layer_norm_rms_epsilon"])
    kv_rank, k_len = int(md[a + "attention.kv_lora_rank"]), int(md[a + "attention.key_length_mla"])
    n_rot, base = int(md[a + "rope.dimension_count"]), float(md[a + "rope.freq_base"])
    nope = k_len - n_rot

    def w(name: str) -> np.ndarray:
        value = get(f"blk.{layer}.{name}.weight")
        assert value is not None, name
        return value.astype(np.float64)

    def rms(v: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * weight

    x = x.astype(np.float64)
    t = x.shape[0]
    pos = np.arange(t)
    q = (rms(x @ w("attn_q_a").T, w("attn_q_a_norm")) @ w("attn_q_b").T).reshape(t, n_head, k_len)
    q_nope, q_pe = q[..., :nope], _reference_rope(q[..., nope:], pos, base)
    kv = x @ w("attn_kv_a_mqa").T
    latent = rms(kv[:, :kv_rank], w("attn_kv_a_norm"))
    k_pe = _reference_rope(kv[:, None, kv_rank:], pos, base)[:, 0]
    q_abs = np.einsum("hcn,thn->thc", w("attn_k_b"), q_nope)  # ggml_mul_mat(wk_b {nope, C, H}, q_nope)
    scores = (np.einsum("thc,sc->ths", q_abs, latent) + np.einsum("thr,sr->ths", q_pe, k_pe)) / math.sqrt(k_len)
    scores = np.where(np.arange(t)[None, None, :] > pos[:, None, None], -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("ths,sc->thc", probs, latent)
    heads = np.einsum("hvc,thc->thv", w("attn_v_b"), out).reshape(t, -1)  # v_mla {C, V, H}
    return heads @ w("attn_output").T


class _Fixture:
    def __init__(self, name: str) -> None:
        path = _fixture(name)
        self.name = name
        self.md = _metadata(path)
        self.get = _tensor_getter(path)
        self.hp = MLAHParams.from_metadata("deepseek2", self.md)
        with np.load(path.with_suffix("").with_suffix(".forward.npz")) as z:
            self.forward = {k: z[k] for k in z.files}
        embd = self.get("token_embd.weight")
        assert embd is not None
        self.embeddings = embd[self.forward["tokens"]]
        self.rope = _rope_norm(float(self.md["deepseek2.rope.freq_base"]))

    def attention_input(self, layer: int) -> np.ndarray:
        return self.forward[f"attn_norm-{layer}"]

    def llama_attention(self, layer: int) -> np.ndarray:
        before = self.embeddings if layer == 0 else self.forward[f"l_out-{layer - 1}"]
        return self.forward[f"ffn_inp-{layer}"].astype(np.float64) - before

    def run(self, layer: int, step: int | None = None, *, like_llama_cpp: bool = False) -> np.ndarray:
        """The block on the 16 prompt tokens: one prefill, or ``step`` tokens per call."""
        w = mla.MLAWeights.from_arrays(layer, self.get, self.hp)
        cache = np.zeros((N_CTX, self.hp.cache_width), np.float32)
        x = self.attention_input(layer)
        step = step or x.shape[0]
        scale = mla.kq_scale(self.hp)
        with pytest.MonkeyPatch.context() as mp:
            if like_llama_cpp:
                mp.setattr(mla, "attend", _llama_cpp_flash_attention)
            parts = [
                mla.mla_attention(x[i : i + step], i, w, self.hp, cache, self.rope, scale)
                for i in range(0, x.shape[0], step)
            ]
        return np.concatenate(parts)


@pytest.fixture(scope="module", params=FILES)
def fixture(request: pytest.FixtureRequest) -> _Fixture:
    return _Fixture(request.param)


# ----------------------------------------------------------------------------------------------
# against llama.cpp


@pytest.mark.parametrize("layer", range(N_LAYER))
def test_attention_matches_llama_cpp(fixture: _Fixture, layer: int) -> None:
    """With llama.cpp's F16 flash attention swapped in, the MLA block gives llama.cpp's attention output."""
    got = fixture.run(layer, like_llama_cpp=True)
    assert _rel(got, fixture.llama_attention(layer)) < BOUND_LLAMA[fixture.name]


@pytest.mark.parametrize("layer", range(N_LAYER))
def test_float32_is_llama_cpp_up_to_its_f16_cache(fixture: _Fixture, layer: int) -> None:
    """The float32 attention differs from llama.cpp by the F16 rounding of its cache and accumulator."""
    got = fixture.run(layer)
    error = _rel(got, fixture.llama_attention(layer))
    assert error < max(1e-3, BOUND_LLAMA[fixture.name])
    if fixture.name.endswith("-f32"):  # the gap is the F16 arithmetic: reproduced, most of it goes
        assert (
            error > 1e-4 and _rel(fixture.run(layer, like_llama_cpp=True), fixture.llama_attention(layer)) < error / 3
        )


@pytest.mark.parametrize("layer", range(N_LAYER))
def test_float32_matches_float64_reference(fixture: _Fixture, layer: int) -> None:
    want = _reference_attention(fixture.attention_input(layer), fixture.get, layer, fixture.md)
    assert _rel(fixture.run(layer), want) < 1e-5


@pytest.mark.parametrize("step", [1, 5])
def test_decode_equals_prefill(fixture: _Fixture, step: int) -> None:
    """Token by token (and 5 at a time) against the latent cache gives the prefill's output."""
    for layer in range(N_LAYER):
        prefill = fixture.run(layer)
        assert _rel(fixture.run(layer, step=step), prefill) < 1e-5


def test_cache_holds_the_latent_and_the_rotated_key(fixture: _Fixture) -> None:
    """Per position the cache row is [attn_kv_a_norm(latent) | rope(k_pe)], kv_lora_rank + rope_dims floats."""
    hp, layer = fixture.hp, 1
    w = mla.MLAWeights.from_arrays(layer, fixture.get, hp)
    cache = np.zeros((N_CTX, hp.cache_width), np.float32)
    x = fixture.attention_input(layer)
    mla.mla_attention(x, 0, w, hp, cache, fixture.rope, mla.kq_scale(hp))
    assert hp.cache_width == 64 + 32
    kv = x.astype(np.float64) @ fixture.get(f"blk.{layer}.attn_kv_a_mqa.weight").T  # type: ignore[union-attr]
    norm = fixture.get(f"blk.{layer}.attn_kv_a_norm.weight")
    latent = kv[:, :64] / np.sqrt(np.mean(kv[:, :64] ** 2, -1, keepdims=True) + hp.rms_eps) * norm
    k_pe = _reference_rope(kv[:, None, 64:], np.arange(16), 10000.0)[:, 0]
    assert _rel(cache[:16, :64], latent) < 1e-5
    assert _rel(cache[:16, 64:], k_pe) < 1e-5
    assert not cache[16:].any()


# ----------------------------------------------------------------------------------------------
# the pieces


def _random_case(rng: np.random.Generator, lite: bool = False) -> tuple[MLAHParams, mla.MLAWeights, dict]:
    hp = MLAHParams(
        n_embd=16, n_head=3, q_lora_rank=0 if lite else 8, kv_lora_rank=6, key_length=12, value_length=5,
        rope_dims=4, rms_eps=1e-6,
    )  # fmt: skip
    shapes = hp.tensor_shapes(0)
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    return hp, mla.MLAWeights.from_arrays(0, arrays.get, hp), arrays


def _matmul(m: np.ndarray) -> mla.Matmul:
    return lambda v: v @ m.T


@pytest.mark.parametrize("lite", [False, True])
def test_per_head_callables_equal_arrays(lite: bool) -> None:
    """k_b / v_b given as per-head matmuls (ggml matrices) give what the (H, rows, cols) arrays give."""
    rng = np.random.default_rng(1)
    hp, w, arrays = _random_case(rng, lite)
    heads = {name: [_matmul(m) for m in arrays[f"blk.0.attn_{name}.weight"]] for name in ("k_b", "v_b")}
    w_callables = mla.MLAWeights(w.q_a, w.q_a_norm, w.q_b, w.kv_a, w.kv_a_norm, heads["k_b"], heads["v_b"], w.output)
    x = rng.standard_normal((7, hp.n_embd)).astype(np.float32)
    rope = _rope_norm(10000.0)
    outs = []
    for weights in (w, w_callables):
        cache = np.zeros((8, hp.cache_width), np.float32)
        outs.append(mla.mla_attention(x, 0, weights, hp, cache, rope, mla.kq_scale(hp)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)  # values up to ~7: 1e-5 is float32 reassociation
    q_nope, _ = mla.project_query(x, w, hp)
    want = np.einsum("hcn,thn->thc", arrays["blk.0.attn_k_b.weight"].astype(np.float64), q_nope)
    np.testing.assert_allclose(mla.absorb_query(q_nope, w.k_b), want, rtol=1e-5, atol=1e-6)


def test_causal_mask() -> None:
    """Changing a cache row after position p does not change the output of the query at p."""
    rng = np.random.default_rng(3)
    q_latent = rng.standard_normal((4, 2, 6)).astype(np.float32)
    q_pe = rng.standard_normal((4, 2, 2)).astype(np.float32)
    rows = rng.standard_normal((4, 8)).astype(np.float32)
    base = mla.latent_attention(q_latent, q_pe, rows, 0, 6, 0.5)
    changed = rows.copy()
    changed[2:] += 10.0
    other = mla.latent_attention(q_latent, q_pe, changed, 0, 6, 0.5)
    assert np.array_equal(base[:2], other[:2])
    assert not np.allclose(base[2:], other[2:])
    np.testing.assert_allclose(base[0], np.broadcast_to(rows[0, :6], (2, 6)), rtol=1e-6)  # only row 0 visible


# ----------------------------------------------------------------------------------------------
# scales


def _hp(**kw: object) -> MLAHParams:
    base: dict = {
        "n_embd": 64,
        "n_head": 2,
        "q_lora_rank": 8,
        "kv_lora_rank": 8,
        "key_length": 192,
        "value_length": 8,
        "rope_dims": 64,
    }
    base.update(kw)
    return MLAHParams(rms_eps=1e-6, **base)


def test_kq_scale_without_scaling_is_one_over_sqrt_key_length() -> None:
    assert mla.kq_scale(_hp(key_length=96)) == pytest.approx(0.10206207, rel=1e-7)  # 1/sqrt(96), the fixture
    # rope.scaling.attn_factor = 2 and no scaling: llama_context hands RoPE attn_factor 2, kq = 2^2/sqrt(96)
    assert mla.kq_scale(_hp(key_length=96), attn_factor=2.0) == pytest.approx(0.40824829, rel=1e-7)


def test_kq_scale_yarn_deepseek_v3() -> None:
    """DeepSeek-V3: YaRN factor 40, mscale_all_dim 1 (yarn_log_multiplier 0.1 in the GGUF), q head 192.

    llama_context: attn_factor = get_mscale(40, 1)/get_mscale(40, 1) / (1 + 0.1 ln 40) = 1/1.36888795.
    deepseek2.cpp: attn_factor_org = 1; mscale = 1 + 0.1 * 1 * ln 40 = 1.36888795 (ln 40 = 3.68887945);
    kq = 1.36888795^2 / sqrt(192) = 1.87385421 / 13.85640646 = 0.13523378 (HF's softmax_scale too).
    """
    hp = _hp(yarn_log_multiplier=0.1)
    assert mla.kq_scale(hp, attn_factor=1 / 1.36888795, freq_scale=1 / 40) == pytest.approx(0.13523378, rel=1e-7)


def test_kq_scale_yarn_deepseek_v2() -> None:
    """DeepSeek-V2: mscale = mscale_all_dim = 0.707 (0.0707 in the GGUF); kq = (1 + 0.0707 ln 40)^2 / sqrt(192).

    1 + 0.0707 * 3.68887945 = 1.26080378; squared 1.58962618; / 13.85640646 = 0.11472139.
    """
    hp = _hp(yarn_log_multiplier=0.0707)
    assert mla.kq_scale(hp, attn_factor=1 / 1.36888795, freq_scale=1 / 40) == pytest.approx(0.11472139, rel=1e-7)


def test_kq_scale_linear_scaling_keeps_llama_cpp_factor() -> None:
    """Linear scaling by 4 (no YaRN: attn_factor 1): deepseek2.cpp still multiplies by 1 + 0.1 ln 4 = 1.13862944.

    kq = 1.13862944^2 / sqrt(96) = 1.29647698 / 9.79795897 = 0.13232113.
    """
    assert mla.kq_scale(_hp(key_length=96), freq_scale=0.25) == pytest.approx(0.13232113, rel=1e-7)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_kq_scale_refuses_bad_factors(bad: float) -> None:
    with pytest.raises(ConfigError, match="attn_factor"):
        mla.kq_scale(_hp(), attn_factor=bad)
    with pytest.raises(ConfigError, match="freq_scale"):
        mla.kq_scale(_hp(), freq_scale=bad)


def test_temperature_scales() -> None:
    """log(floor(pos / 8192) + 1) * 0.1 + 1: 1 for positions 0..8191, 1 + 0.1 ln 2 = 1.06931472 at 8192."""
    assert mla.temperature_scales(_hp(), np.arange(3)) is None
    got = mla.temperature_scales(_hp(temperature_scale=0.1, temperature_length=8192), np.array([0, 8191, 8192, 24576]))
    assert got is not None
    np.testing.assert_allclose(got, [1.0, 1.0, 1.06931472, 1.13862944], rtol=1e-6)


def test_temperature_scales_the_query() -> None:
    """With a temperature, position p's scores are those of a query scaled by its factor."""
    rng = np.random.default_rng(4)
    hp, w, _ = _random_case(rng)
    hp_t = MLAHParams(
        **{**{f: getattr(hp, f) for f in hp.__dataclass_fields__}, "temperature_scale": 0.5, "temperature_length": 2}
    )
    x = rng.standard_normal((5, hp.n_embd)).astype(np.float32)
    rope = _rope_norm(10000.0)
    outs = {}
    for name, h in (("plain", hp), ("temp", hp_t)):
        cache = np.zeros((8, hp.cache_width), np.float32)
        outs[name] = mla.mla_attention(x, 0, w, h, cache, rope, mla.kq_scale(hp))
    np.testing.assert_array_equal(outs["temp"][:2], outs["plain"][:2])  # factor 1 at positions 0, 1
    assert not np.allclose(outs["temp"][2:], outs["plain"][2:])
    cache = np.zeros((8, hp.cache_width), np.float32)
    factor = 1 + 0.5 * math.log(2)  # positions 2 and 3
    scaled = mla.mla_attention(x[:4], 0, w, hp, cache, rope, mla.kq_scale(hp) * factor)
    np.testing.assert_allclose(outs["temp"][2:4], scaled[2:4], rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# hyper-parameters and bad input


def _fixture_metadata() -> dict[str, object]:
    return _metadata(_fixture("deepseek2-f32"))


def test_hparams_of_the_fixture() -> None:
    hp = MLAHParams.from_metadata("deepseek2", _fixture_metadata())
    assert (hp.n_embd, hp.n_head, hp.q_lora_rank, hp.kv_lora_rank) == (256, 4, 128, 64)
    assert (hp.key_length, hp.value_length, hp.rope_dims, hp.nope_dims, hp.cache_width) == (96, 64, 32, 64, 96)
    assert hp.yarn_log_multiplier == 0.0 and hp.temperature_scale == 0.0
    assert hp.rms_eps == pytest.approx(1e-6)


def test_hparams_lite_variant_has_no_q_lora() -> None:
    """deepseek2.cpp: 27-layer files (DeepSeek-V2-Lite) are not asked for q_lora_rank and use attn_q."""
    md = {k: v for k, v in _fixture_metadata().items() if k != "deepseek2.attention.q_lora_rank"}
    md["deepseek2.block_count"] = 27
    hp = MLAHParams.from_metadata("deepseek2", md)
    assert hp.q_lora_rank == 0
    assert "blk.0.attn_q.weight" in hp.tensor_shapes(0) and "blk.0.attn_q_a.weight" not in hp.tensor_shapes(0)
    md["deepseek2.block_count"] = 3
    with pytest.raises(FormatError, match="q_lora_rank"):
        MLAHParams.from_metadata("deepseek2", md)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"deepseek2.attention.key_length_mla": None}, FormatError, "set together"),
        ({"deepseek2.attention.value_length_mla": 0}, FormatError, "set together"),
        ({"deepseek2.rope.dimension_count": 33}, FormatError, "even"),
        ({"deepseek2.rope.dimension_count": 96}, FormatError, "smaller than"),
        ({"deepseek2.attention.kv_lora_rank": 0}, FormatError, "kv_lora_rank must be > 0"),
        ({"deepseek2.attention.kv_lora_rank": "64"}, FormatError, "must be an integer"),
        ({"deepseek2.attention.layer_norm_rms_epsilon": None}, FormatError, "missing required key"),
        ({"deepseek2.attention.layer_norm_rms_epsilon": 0.0}, FormatError, "must be > 0"),
        ({"deepseek2.rope.scaling.yarn_log_multiplier": math.nan}, FormatError, "finite"),
        ({"deepseek2.attention.temperature_scale": 0.1}, FormatError, "temperature_length"),
        ({"deepseek2.attention.head_count": [4, 4, 4]}, UnsupportedTypeError, "per-layer"),
    ],
)
def test_hparams_refuse_bad_metadata(change: dict, error: type[Exception], match: str) -> None:
    md = _fixture_metadata()
    for key, value in change.items():
        if value is None:
            md.pop(key)
        else:
            md[key] = value
    with pytest.raises(error, match=match):
        MLAHParams.from_metadata("deepseek2", md)


def test_hparams_refuse_other_architectures() -> None:
    with pytest.raises(UnsupportedTypeError, match="no MLA attention"):
        MLAHParams.from_metadata("qwen3moe", {})


def test_weights_refuse_missing_misshaped_and_nan() -> None:
    rng = np.random.default_rng(5)
    hp, _, arrays = _random_case(rng)
    missing = dict(arrays)
    del missing["blk.0.attn_v_b.weight"]
    with pytest.raises(FormatError, match="attn_v_b.weight is missing"):
        mla.MLAWeights.from_arrays(0, missing.get, hp)
    bad = dict(arrays)
    bad["blk.0.attn_k_b.weight"] = bad["blk.0.attn_k_b.weight"].transpose(0, 2, 1)
    with pytest.raises(FormatError, match="attn_k_b.weight has shape"):
        mla.MLAWeights.from_arrays(0, bad.get, hp)
    nan = dict(arrays)
    nan["blk.0.attn_q_b.weight"] = nan["blk.0.attn_q_b.weight"].copy()
    nan["blk.0.attn_q_b.weight"][0, 0] = np.nan
    with pytest.raises(FormatError, match="NaN"):
        mla.MLAWeights.from_arrays(0, nan.get, hp)


def test_attention_refuses_bad_shapes() -> None:
    rng = np.random.default_rng(6)
    hp, w, _ = _random_case(rng)
    rope = _rope_norm(10000.0)
    x = rng.standard_normal((3, hp.n_embd)).astype(np.float32)
    cache = np.zeros((4, hp.cache_width), np.float32)
    with pytest.raises(ConfigError, match="cannot take positions"):
        mla.mla_attention(x, 2, w, hp, cache, rope, 0.1)  # positions 2..4 of a 4-row cache
    with pytest.raises(ConfigError, match="cannot take positions"):
        mla.mla_attention(x, 0, w, hp, np.zeros((4, hp.cache_width + 1), np.float32), rope, 0.1)
    with pytest.raises(ConfigError, match="float32"):
        mla.mla_attention(x.astype(np.float64), 0, w, hp, cache, rope, 0.1)
    q = np.zeros((2, hp.n_head, hp.kv_lora_rank), np.float32)
    q_pe = np.zeros((2, hp.n_head, hp.rope_dims), np.float32)
    with pytest.raises(ConfigError, match="do not fit"):
        mla.latent_attention(q, q_pe, np.zeros((3, hp.cache_width), np.float32), 0, hp.kv_lora_rank, 0.1)
    with pytest.raises(ConfigError, match="do not fit"):
        mla.latent_attention(q, q_pe, np.zeros((2, hp.cache_width), np.float32), 0, hp.kv_lora_rank + 1, 0.1)


def test_long_batches_run_in_chunks_of_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLA's 1-KV-head attention through attend's chunking (a tiny score budget) gives the one-shot result."""
    from aioexperts._compute import attention

    rng = np.random.default_rng(8)
    q_latent = rng.standard_normal((9, 3, 6)).astype(np.float32)
    q_pe = rng.standard_normal((9, 3, 2)).astype(np.float32)
    rows = rng.standard_normal((13, 8)).astype(np.float32)
    whole = mla.latent_attention(q_latent, q_pe, rows, 4, 6, 0.4)
    monkeypatch.setattr(attention, "SCORE_BYTES", 4 * 3 * 13 * 2)  # two queries per chunk
    np.testing.assert_allclose(mla.latent_attention(q_latent, q_pe, rows, 4, 6, 0.4), whole, rtol=1e-5, atol=1e-6)
