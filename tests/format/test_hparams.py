"""MoEHParams.from_metadata: per-arch defaults as llama.cpp resolves them, and metadata errors."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import shared_fixtures_dir

from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.hparams import Activation, GatingFunc, MoEHParams

FIXTURES = shared_fixtures_dir()


def _gguf_metadata(name: str) -> dict[str, object]:
    gguf = pytest.importorskip("gguf")
    if FIXTURES is None or not (FIXTURES / name).exists():
        pytest.skip(f"fixture {name} not found")
    reader = gguf.GGUFReader(FIXTURES / name)
    return {key: field.contents() for key, field in reader.fields.items()}


def _from_gguf(name: str) -> MoEHParams:
    md = _gguf_metadata(name)
    return MoEHParams.from_metadata(str(md["general.architecture"]), md)


def _md(arch: str, **keys: object) -> dict[str, object]:
    base = {"embedding_length": 64, "expert_count": 8, "expert_used_count": 2, "block_count": 4}
    base.update(keys)
    return {f"{arch}.{k}": v for k, v in base.items() if v is not None}


# --------------------------------------------------------------------------------------------------
# the fixtures


@pytest.mark.parametrize("name", ["qwen3moe-f32.gguf", "qwen3moe-q4_k_m.gguf", "qwen3moe-mixed.gguf"])
def test_qwen3moe_fixture(name: str) -> None:
    hp = _from_gguf(name)
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_expert, hp.n_expert_used) == ("qwen3moe", 3, 256, 8, 2)
    assert hp.n_ff_exp == 256
    assert hp.gating_func is GatingFunc.SOFTMAX
    assert hp.weights_norm is True
    assert hp.weights_scale == 1.0
    assert hp.n_expert_shared == 0
    assert hp.n_ff_shexp == 0
    assert not hp.has_shared_expert
    assert hp.n_expert_groups == 0
    assert not hp.uses_groups
    assert hp.activation is Activation.SILU
    assert [hp.is_moe_layer(i) for i in range(-1, 4)] == [False, True, True, True, False]


def test_qwen2moe_fixture() -> None:
    hp = _from_gguf("qwen2moe-f32.gguf")
    assert hp.gating_func is GatingFunc.SOFTMAX
    assert hp.weights_norm is False
    assert hp.weights_scale == 1.0
    assert hp.n_ff_exp == 256
    assert (hp.n_expert_shared, hp.n_ff_shexp) == (1, 512)


def test_glm4moe_fixture() -> None:
    hp = _from_gguf("glm4moe-q4_k_m.gguf")
    assert hp.gating_func is GatingFunc.SIGMOID
    assert hp.weights_norm is True
    assert hp.weights_scale == 2.5
    assert (hp.n_expert_groups, hp.n_group_used) == (4, 2)
    assert hp.uses_groups
    assert hp.n_layer_dense_lead == 1
    assert [hp.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert (hp.n_expert_shared, hp.n_ff_shexp) == (1, 256)  # n_ff_exp * expert_shared_count


# --------------------------------------------------------------------------------------------------
# per-arch defaults


def test_qwen3moe_and_mixtral_fixed_softmax_norm() -> None:
    for arch in ("qwen3moe", "llama"):
        md = _md(arch, feed_forward_length=512, expert_feed_forward_length=128)
        hp = MoEHParams.from_metadata(arch, md)
        assert hp.gating_func is GatingFunc.SOFTMAX
        assert hp.weights_norm is True
        assert hp.weights_scale == 1.0
    # llama.cpp hard-codes these at the call site: the keys do not change them
    md = _md(
        "qwen3moe",
        expert_feed_forward_length=128,
        expert_weights_norm=False,
        expert_weights_scale=3.0,
        expert_gating_func=2,
    )
    hp = MoEHParams.from_metadata("qwen3moe", md)
    assert hp.gating_func is GatingFunc.SOFTMAX
    assert hp.weights_norm is True
    assert hp.weights_scale == 1.0


def test_n_ff_exp_fallbacks() -> None:
    # qwen*: n_ff / n_expert_used when the expert key is absent
    hp = MoEHParams.from_metadata("qwen3moe", _md("qwen3moe", feed_forward_length=512))
    assert hp.n_ff_exp == 256
    # Mixtral / OLMoE experts are feed_forward_length wide
    hp = MoEHParams.from_metadata("llama", _md("llama", feed_forward_length=512))
    assert hp.n_ff_exp == 512
    hp = MoEHParams.from_metadata("olmoe", _md("olmoe", feed_forward_length=1024))
    assert hp.n_ff_exp == 1024
    assert hp.weights_norm is False
    with pytest.raises(FormatError, match=r"qwen3moe\.expert_feed_forward_length"):
        MoEHParams.from_metadata("qwen3moe", _md("qwen3moe"))


def test_qwen2moe_defaults() -> None:
    hp = MoEHParams.from_metadata("qwen2moe", _md("qwen2moe", feed_forward_length=512, expert_weights_scale=2.0))
    assert hp.gating_func is GatingFunc.SOFTMAX
    assert hp.weights_norm is False
    assert hp.weights_scale == 1.0  # qwen2moe's loader never reads the scale
    assert hp.n_ff_exp == 256
    assert (hp.n_expert_shared, hp.n_ff_shexp) == (1, 512)


def test_deepseek2_reads_keys() -> None:
    md = _md(
        "deepseek2",
        expert_feed_forward_length=32,
        expert_shared_count=2,
        leading_dense_block_count=1,
        expert_weights_scale=2.5,
        expert_weights_norm=True,
        expert_gating_func=2,
        expert_group_count=4,
        expert_group_used_count=2,
    )
    hp = MoEHParams.from_metadata("deepseek2", md)
    assert hp.gating_func is GatingFunc.SIGMOID
    assert hp.weights_norm is True
    assert hp.weights_scale == 2.5
    assert (hp.n_expert_groups, hp.n_group_used) == (4, 2)
    assert (hp.n_expert_shared, hp.n_ff_shexp) == (2, 64)
    assert hp.n_layer_dense_lead == 1
    assert not hp.is_moe_layer(0)
    assert hp.is_moe_layer(1)


def test_deepseek2_defaults() -> None:
    md = _md("deepseek2", expert_feed_forward_length=32, expert_shared_count=1)
    hp = MoEHParams.from_metadata("deepseek2", md)
    # DeepSeek V2 / V2.5 GGUFs have no expert_gating_func: softmax
    assert hp.gating_func is GatingFunc.SOFTMAX
    assert hp.weights_norm is False
    assert hp.weights_scale == 1.0
    # ...except GLM-4.7 Lite (47 or 48 layers, vocabulary 154880): sigmoid
    lite = dict(md, **{"deepseek2.block_count": 47, "deepseek2.vocab_size": 154880})
    assert MoEHParams.from_metadata("deepseek2", lite).gating_func is GatingFunc.SIGMOID
    # gating 0 (NONE) is "not set"
    md0 = dict(md, **{"deepseek2.expert_gating_func": 0})
    assert MoEHParams.from_metadata("deepseek2", md0).gating_func is GatingFunc.SOFTMAX
    with pytest.raises(FormatError, match=r"deepseek2\.expert_feed_forward_length"):
        MoEHParams.from_metadata("deepseek2", _md("deepseek2", expert_shared_count=1))
    with pytest.raises(FormatError, match=r"deepseek2\.expert_shared_count"):
        MoEHParams.from_metadata("deepseek2", _md("deepseek2", expert_feed_forward_length=32))


def test_deepseek_v1_fixed() -> None:
    md = _md("deepseek", expert_feed_forward_length=32, expert_shared_count=2, expert_weights_scale=1.5)
    hp = MoEHParams.from_metadata("deepseek", md)
    assert hp.gating_func is GatingFunc.SOFTMAX
    assert hp.weights_norm is False
    assert hp.weights_scale == 1.0
    assert hp.n_ff_shexp == 64


def test_glm4moe_defaults() -> None:
    md = _md("glm4moe", expert_feed_forward_length=32, expert_shared_count=1)
    hp = MoEHParams.from_metadata("glm4moe", md)
    assert hp.gating_func is GatingFunc.SIGMOID  # GLM-4.5 default when the key is missing
    assert hp.weights_norm is False
    assert hp.weights_scale == 1.0
    md["glm4moe.expert_weights_scale"] = 0.0  # 0 means "no scaling"
    assert MoEHParams.from_metadata("glm4moe", md).weights_scale == 1.0


def test_gpt_oss() -> None:
    md = _md("gpt-oss", expert_feed_forward_length=64, expert_weights_norm=True, expert_gating_func=1)
    hp = MoEHParams.from_metadata("gpt-oss", md)
    assert hp.gating_func is GatingFunc.SOFTMAX_WEIGHT
    assert hp.weights_norm is False
    assert hp.weights_scale == 1.0
    assert hp.activation is Activation.SWIGLU_OAI
    assert (hp.swiglu_alpha, hp.swiglu_limit) == (1.702, 7.0)
    assert not hp.has_shared_expert
    with pytest.raises(FormatError, match=r"gpt-oss\.expert_feed_forward_length"):
        MoEHParams.from_metadata("gpt-oss", _md("gpt-oss"))


def test_unknown_arch_generic_path() -> None:
    hp = MoEHParams.from_metadata("mymoe", _md("mymoe"))
    assert hp.gating_func is GatingFunc.SOFTMAX
    assert hp.weights_norm is False
    assert hp.weights_scale == 1.0
    assert hp.n_ff_exp == 0  # unknown: taken from the views
    assert hp.activation is Activation.SILU
    md = _md(
        "mymoe",
        expert_feed_forward_length=48,
        expert_gating_func=3,
        expert_weights_norm=1,
        expert_weights_scale=16,
        expert_shared_count=2,
    )
    hp = MoEHParams.from_metadata("mymoe", md)
    assert hp.gating_func is GatingFunc.SOFTMAX_WEIGHT
    assert hp.weights_norm is True
    assert hp.weights_scale == 16.0
    assert (hp.n_ff_exp, hp.n_expert_shared, hp.n_ff_shexp) == (48, 2, 96)
    # only the three keys the brief calls required
    minimal = {"x.expert_count": 4, "x.expert_used_count": 1, "x.embedding_length": 8}
    hp = MoEHParams.from_metadata("x", minimal)
    assert (hp.n_layer, hp.n_expert, hp.n_expert_used, hp.n_embd) == (0, 4, 1, 8)
    assert hp.is_moe_layer(100)


# --------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("key", ["expert_count", "expert_used_count", "embedding_length"])
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "mymoe"])
def test_missing_required_key(arch: str, key: str) -> None:
    md = _md(arch, feed_forward_length=512, expert_feed_forward_length=32, expert_shared_count=1)
    del md[f"{arch}.{key}"]
    if key == "expert_count":  # a dense model: said so, not as a missing key
        message = rf"^the file is not a MoE model \(no {arch}\.expert_count\): aioexperts streams the experts of MoE"
    else:
        message = rf"missing required key {arch}\.{key}"
    with pytest.raises(FormatError, match=message):
        MoEHParams.from_metadata(arch, md)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"expert_used_count": 9}, r"expert_used_count must be in 1\.\.8"),
        ({"expert_used_count": 0}, r"expert_used_count must be in 1\.\.8"),
        ({"expert_count": 0}, r"expert_count must be > 0"),
        ({"embedding_length": 0}, r"embedding_length must be > 0"),
        ({"expert_count": "8"}, r"expert_count must be an integer, got '8'"),
        ({"expert_count": True}, r"expert_count must be an integer"),
        ({"expert_weights_scale": "x"}, r"expert_weights_scale must be a number"),
        ({"expert_weights_norm": 2}, r"expert_weights_norm must be a boolean"),
        ({"expert_group_count": 3, "expert_group_used_count": 1}, r"expert_group_count=3 does not divide"),
        ({"expert_group_count": 4, "expert_group_used_count": 0}, r"group_used_count must be in 1\.\.4"),
        ({"expert_group_count": 4, "expert_group_used_count": 1, "expert_used_count": 3}, r"top-3 cannot"),
        ({"leading_dense_block_count": 5}, r"leading_dense_block_count=5 exceeds"),
        ({"block_count": 513}, r"block_count=513 is more than llama\.cpp's 512 blocks"),
        ({"block_count": 2**32 - 1}, r"block_count=4294967295 is more than"),
    ],
)
def test_bad_values(keys: dict[str, object], message: str) -> None:
    with pytest.raises(FormatError, match=message):
        MoEHParams.from_metadata("mymoe", _md("mymoe", **keys))


def test_unsupported() -> None:
    with pytest.raises(UnsupportedTypeError, match=r"expert_gating_func=5"):
        MoEHParams.from_metadata("mymoe", _md("mymoe", expert_gating_func=5))
    with pytest.raises(UnsupportedTypeError, match="arctic adds a parallel dense FFN"):
        MoEHParams.from_metadata("arctic", _md("arctic"))
    with pytest.raises(UnsupportedTypeError, match=r"'jamba' is not supported: its MoE graph has not been"):
        MoEHParams.from_metadata("jamba", _md("jamba"))
    with pytest.raises(UnsupportedTypeError, match=r"'qwen2' has no MoE layer in llama\.cpp that this executor"):
        MoEHParams.from_metadata("qwen2", _md("qwen2"))
    with pytest.raises(UnsupportedTypeError, match="per-layer array"):
        MoEHParams.from_metadata("mymoe", _md("mymoe", expert_used_count=[2, 2, 2, 2]))
    assert issubclass(UnsupportedTypeError, FormatError)
    with pytest.raises(FormatError, match="non-empty string"):
        MoEHParams.from_metadata("", {})
    with pytest.raises(FormatError, match="mapping"):
        MoEHParams.from_metadata("mymoe", [("mymoe.expert_count", 8)])


def test_frozen() -> None:
    hp = MoEHParams.from_metadata("mymoe", _md("mymoe"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        hp.n_expert = 4


@pytest.mark.parametrize("value", [7.0, [0.0, 7.0, 0.0, 0.0]])
@pytest.mark.parametrize("key", ["swiglu_clamp_exp", "swiglu_clamp_shexp"])
def test_swiglu_clamps_are_refused_not_ignored(key: str, value: object) -> None:
    with pytest.raises(UnsupportedTypeError, match=rf"qwen3moe\.{key} sets a SwiGLU clamp"):
        MoEHParams.from_metadata("qwen3moe", _md("qwen3moe", expert_feed_forward_length=32, **{key: value}))
    MoEHParams.from_metadata("qwen3moe", _md("qwen3moe", expert_feed_forward_length=32, **{key: [0.0] * 4}))


@pytest.mark.parametrize("arch", ["dots1", "minimax-m2", "bailingmoe2"])
def test_gating_key_is_required_where_llama_cpp_has_no_default(arch: str) -> None:
    md = _md(arch, expert_feed_forward_length=32, expert_shared_count=1)
    with pytest.raises(FormatError, match=rf"missing required key {arch}\.expert_gating_func"):
        MoEHParams.from_metadata(arch, md)
    hp = MoEHParams.from_metadata(arch, {**md, f"{arch}.expert_gating_func": 2})
    assert hp.gating_func is GatingFunc.SIGMOID


@pytest.mark.parametrize("arch", ["ernie4_5-moe", "llama4"])
def test_interleaved_archs(arch: str) -> None:
    md = _md(arch, expert_feed_forward_length=32, block_count=6)
    with pytest.raises(FormatError, match=rf"missing required key {arch}\.interleave_moe_layer_step"):
        MoEHParams.from_metadata(arch, md)
    hp = MoEHParams.from_metadata(arch, {**md, f"{arch}.interleave_moe_layer_step": 2})
    assert [hp.is_moe_layer(b) for b in range(6)] == [False, True, False, True, False, True]
    assert hp.n_moe_layer_step == 2


def test_llama4_routing_flags() -> None:
    md = _md("llama4", expert_feed_forward_length=32, interleave_moe_layer_step=1)
    hp = MoEHParams.from_metadata("llama4", md)
    assert hp.select_on_logits and hp.weights_before_experts
    assert hp.gating_func is GatingFunc.SIGMOID and not hp.weights_norm
    assert (hp.n_expert_shared, hp.n_ff_shexp) == (1, 32)


def test_leading_dense_key_is_ignored_where_the_graph_ignores_it() -> None:
    hp = MoEHParams.from_metadata("llama", _md("llama", feed_forward_length=32, leading_dense_block_count=1))
    assert hp.n_layer_dense_lead == 0 and hp.is_moe_layer(0)
    hp = MoEHParams.from_metadata("deepseek", _md("deepseek", expert_feed_forward_length=32, expert_shared_count=1,
                                                  leading_dense_block_count=1))  # fmt: skip
    assert hp.n_layer_dense_lead == 1 and not hp.is_moe_layer(0)


def test_nextn_count_must_be_below_the_block_count() -> None:
    with pytest.raises(FormatError, match=r"glm4moe\.nextn_predict_layers=4 must be below glm4moe\.block_count=4"):
        MoEHParams.from_metadata(
            "glm4moe", _md("glm4moe", expert_feed_forward_length=32, expert_shared_count=1, nextn_predict_layers=4)
        )
