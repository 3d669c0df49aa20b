"""RoPE (pairing, scaling, YaRN) against a per-element transcription of ggml's loop; the architecture records."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import shared_fixture_paths

import aioexperts
from aioexperts._compute.rope import apply_rope, rope_cos_sin, yarn_corr_dims
from aioexperts._format.architectures import RopeParams, RopeType, model_hparams
from aioexperts._format.archs import MODEL_RECORDS as ARCHITECTURES


def reference_rope(x: np.ndarray, pos: int, p: RopeParams) -> np.ndarray:
    """ops.cpp ggml_rope_cache_init + rope_yarn + rotate_pairs for one head, one element at a time:
    theta in float32 as ggml iterates it (``theta *= theta_scale`` per pair), the rest in float64."""
    out = x.astype(np.float64).copy()
    low, high = yarn_corr_dims(p.n_rot, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
    theta_scale = np.float32(p.freq_base ** float(np.float32(-2.0) / np.float32(p.n_rot)))  # powf
    theta_f32 = np.float32(pos)
    for i0 in range(0, p.n_rot, 2):
        theta_extrap = float(theta_f32)
        theta_f32 = np.float32(theta_f32 * theta_scale)
        theta = p.freq_scale * theta_extrap
        mscale = p.attn_factor
        if p.ext_factor:
            y = (i0 // 2 - low) / max(0.001, high - low)
            mix = (1 - min(1, max(0, y))) * p.ext_factor
            theta = theta * (1 - mix) + theta_extrap * mix
            mscale *= 1 + 0.1 * math.log(1 / p.freq_scale)
        c, s = math.cos(theta) * mscale, math.sin(theta) * mscale
        a, b = (i0, i0 + 1) if p.rope_type == RopeType.NORM else (i0 // 2, i0 // 2 + p.n_rot // 2)
        out[a] = x[a] * c - x[b] * s
        out[b] = x[a] * s + x[b] * c
    return out


@pytest.mark.parametrize("rope_type", [RopeType.NORM, RopeType.NEOX])
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"freq_scale": 0.25},  # linear scaling, factor 4
        {"freq_scale": 0.25, "ext_factor": 1.0, "n_ctx_orig": 4096},  # YaRN
        {"n_rot": 32},  # partial rotary: the other 32 dims pass through
    ],
    ids=["plain", "linear", "yarn", "partial"],
)
def test_rope_matches_ggml_s_loop(rope_type: RopeType, params: dict[str, float]) -> None:
    p = RopeParams(rope_type=rope_type, n_rot=int(params.get("n_rot", 64)), freq_base=1e6, n_ctx_orig=128)
    p = RopeParams(**{**{f: getattr(p, f) for f in p.__dataclass_fields__}, **params})  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    positions = np.array([0, 1, 7, 100, 3000])
    cos, sin = rope_cos_sin(p, positions)
    got = apply_rope(x, cos, sin, p.rope_type, p.n_rot)
    for t, pos in enumerate(positions):
        for h in range(3):
            np.testing.assert_allclose(got[t, h], reference_rope(x[t, h], int(pos), p), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[:, :, p.n_rot :], x[:, :, p.n_rot :])


def test_yarn_magnitude_is_llama_cpp_s() -> None:
    """llama-context.cpp cancels rope_yarn's 1 + 0.1 ln(factor) in attn_factor except for get_mscale's."""
    from aioexperts._format.architectures import _rope_params
    from aioexperts._format.keys import ArchKeys

    md = ArchKeys("qwen3moe", {"qwen3moe.rope.scaling.type": "yarn", "qwen3moe.rope.scaling.factor": 4.0})
    p = _rope_params(md, RopeType.NEOX, 64, 1e6, 40960, 0.0)
    assert p.ext_factor == 1.0 and p.freq_scale == 0.25 and p.n_ctx_orig == 40960
    cos, sin = rope_cos_sin(p, np.arange(4))
    # attn_factor = get_mscale(4, 1) / (1 + 0.1 ln 4) = 1; rope_yarn multiplies by 1 + 0.1 ln 4 again
    assert p.attn_factor == pytest.approx(1.0)
    np.testing.assert_allclose(cos**2 + sin**2, (1 + 0.1 * math.log(4)) ** 2, rtol=1e-5)
    with pytest.raises(aioexperts.UnsupportedTypeError, match="longrope"):
        _rope_params(ArchKeys("qwen3moe", {"qwen3moe.rope.scaling.type": "longrope"}), RopeType.NEOX, 64, 1e6, 10, 0.0)


FIXTURES = {p.stem: p for p in shared_fixture_paths()}


@pytest.mark.skipif("gpt-oss-f32" not in FIXTURES, reason="shared fixtures not found")
def test_the_records_read_the_fixtures_as_the_readme_describes_them() -> None:
    # the fixtures of the main README (next-archs/ has its own README and tests: test_qwen35moe.py)
    main = [name for name in ARCHITECTURES if FIXTURES[f"{name}-f32"].parent.name != "next-archs"]
    hp = {name: model_hparams(aioexperts.open_model(FIXTURES[f"{name}-f32"])) for name in main}
    assert {a: h.rope.rope_type for a, h in hp.items()} == {
        "qwen3moe": RopeType.NEOX, "qwen2moe": RopeType.NEOX, "glm4moe": RopeType.NEOX, "llama": RopeType.NORM,
        "olmoe": RopeType.NEOX, "granitemoe": RopeType.NORM, "gpt-oss": RopeType.NEOX, "deepseek2": RopeType.NORM,
    }  # fmt: skip
    assert all(h.n_layer == 3 and h.n_embd == 256 and h.n_head == 4 for h in hp.values())
    assert all(h.head_k == 64 for a, h in hp.items() if a != "deepseek2")
    d = hp["deepseek2"]  # MLA: key_length is latent + RoPE key (64 + 32), RoPE on 32 dims, one KV head
    assert (d.head_k, d.head_v, d.rope.n_rot, d.n_head_kv, d.n_dense_lead) == (96, 64, 32, 1, 1)
    assert hp["olmoe"].n_head_kv == 4 and hp["qwen3moe"].n_head_kv == 2
    assert hp["gpt-oss"].swa_layers == (True, False, True) and hp["gpt-oss"].n_swa == 8
    assert hp["gpt-oss"].window(0) == 8 and hp["gpt-oss"].window(1) == 0
    g = hp["granitemoe"]
    assert (g.embedding_scale, g.residual_scale, g.logit_scale) == (2.0, 0.5, 4.0)
    assert g.attention_scale == pytest.approx(0.1)
    assert hp["glm4moe"].n_dense_lead == 1 and hp["qwen3moe"].n_dense_lead == 0
    assert all(h.n_vocab == 64 and h.eog_ids == frozenset() and h.n_ctx_train == 128 for h in hp.values())
