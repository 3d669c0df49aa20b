"""The deepseek2 block of the whole model (aioexperts/_model/mla_block.py): weights in their ggml type,
the latent KV cache entry, YaRN's score scale through the model's RoPE parameters, old files with one
``attn_kv_b``, refusals.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import anyio
import gguf
import numpy as np
import pytest
from conftest import shared_fixtures_dir
from gguf_rewrite import rewrite

import aioexperts
from aioexperts._compute import fused, mla
from aioexperts._compute.rope import apply_rope, rope_cos_sin
from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.architectures import RopeType, model_hparams
from aioexperts._format.archs import MODEL_RECORDS as ARCHITECTURES
from aioexperts._format.dequant import dequantize
from aioexperts._format.mla import MLAHParams
from aioexperts._format.model import GGUFModel, open_model
from aioexperts._model.blocks import BLOCKS
from aioexperts._model.mla_block import MLABlock
from aioexperts._model.weights import TensorReader


def _open(name: str) -> GGUFModel:
    root = shared_fixtures_dir()
    path = None if root is None else root / "more-archs" / f"{name}.gguf"
    if path is None or not path.exists():
        pytest.skip(f"shared fixture {name}.gguf not found")
    return open_model(path)


def _with_metadata(model: GGUFModel, **changes: Any) -> GGUFModel:
    """The same file with ``deepseek2.<key>`` metadata changed (None removes a key)."""
    md = dict(model.metadata)
    for key, value in changes.items():
        full = "deepseek2." + key.replace("__", ".")
        if value is None:
            md.pop(full, None)
        else:
            md[full] = value
    return GGUFModel(model.path, model.shards, md, model.skipped_arrays, dict(model.tensors), model.alignment)


def _with_tensor(model: GGUFModel, name: str, like: str) -> GGUFModel:
    """The same file with one more tensor entry ``name`` (pointing at ``like``'s bytes)."""
    tensors = dict(model.tensors)
    tensors[name] = dataclasses.replace(tensors[like], name=name)
    return GGUFModel(model.path, model.shards, dict(model.metadata), model.skipped_arrays, tensors, model.alignment)


def _dequantized(model: GGUFModel):  # noqa: ANN202
    def get(name: str) -> np.ndarray | None:
        info = model.tensors.get(name)
        if info is None:
            return None
        raw = np.frombuffer(model.read_tensor_bytes(name), np.uint8)
        return dequantize(raw, info.ggml_type, info.shape)

    return get


def test_deepseek2_is_registered() -> None:
    record = ARCHITECTURES["deepseek2"]
    assert (record.block, record.rope_type, record.dense_lead) == ("mla", RopeType.NORM, True)
    assert BLOCKS["mla"] is MLABlock


@pytest.mark.parametrize("name", ["deepseek2-f32", "deepseek2-q4_k_m"])
def test_block_with_ggml_matrices_equals_the_float32_maths(name: str) -> None:
    """The block (matrices in their ggml type, k_b/v_b per head) computes what the float32 weights give
    (with float32 activations: precision "float")."""
    fused.set_precision("float")
    try:
        _block_equals_the_float32_maths(name)
    finally:
        fused.set_precision(None)


def _block_equals_the_float32_maths(name: str) -> None:
    model = _open(name)
    hp = model_hparams(model)
    assert hp.rope.n_rot == 32 and hp.rope.attn_factor == 1.0 and hp.rope.freq_scale == 1.0
    with np.load(Path(model.path).with_suffix(".forward.npz")) as z:
        x = z["attn_norm-1"]
    block = MLABlock(hp, TensorReader(model), 1)
    assert block.cache_shapes() == {"kv": (64 + 32,)}
    assert block.scale == pytest.approx(1 / math.sqrt(96), rel=1e-12)
    cache = {"kv": np.zeros((20, 96), np.float32)}
    got = np.concatenate([block.attention(x[:10], cache, 0), block.attention(x[10:], cache, 10)])
    assert not cache["kv"][16:].any() and (np.abs(cache["kv"][:16]).sum(axis=1) > 0).all()

    mhp = MLAHParams.from_metadata("deepseek2", model.metadata)
    weights = mla.MLAWeights.from_arrays(1, _dequantized(model), mhp)

    def rope(v: np.ndarray, pos: np.ndarray) -> np.ndarray:
        cos, sin = rope_cos_sin(hp.rope, pos)
        return apply_rope(v, cos, sin, RopeType.NORM, 32)

    want = mla.mla_attention(x, 0, weights, mhp, np.zeros((20, 96), np.float32), rope, 1 / math.sqrt(96))
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-5


def test_the_kv_estimate_before_the_blocks_are_built_is_their_latent_cache() -> None:
    """The memory check of load(n_ctx=...) runs before the blocks exist: its per-position bytes are the
    MLA blocks' latent and rotated key, not K and V of every head (which would refuse a fitting n_ctx)."""
    from aioexperts._model.kvcache import cache_bytes_per_position
    from aioexperts._model.memory import kv_bytes_per_position

    model = _open("deepseek2-f32")
    hp = model_hparams(model)
    reader = TensorReader(model)
    blocks = [MLABlock(hp, reader, il) for il in range(hp.n_layer)]
    exact = cache_bytes_per_position([dict(b.cache_shapes()) for b in blocks])
    assert kv_bytes_per_position(hp, model) == exact
    assert kv_bytes_per_position(hp) > exact  # the K/V estimate without the file's MLA keys


def test_yarn_scale_through_the_model_rope_parameters() -> None:
    """DeepSeek-V3's YaRN keys on the fixture: llama_context's attn_factor, then deepseek2's kq_scale.

    factor 40, yarn_log_multiplier 0.1 (mscale_all_dim 1): RoPE gets attn_factor = 1 / (1 + 0.1 ln 40)
    = 1 / 1.36888795 = 0.73051998 (its cos/sin magnitude is 1 again inside rope_yarn), and
    kq_scale = (1 + 0.1 ln 40)^2 / sqrt(96) = 1.87385421 / 9.79795897 = 0.19124944.
    """
    model = _with_metadata(
        _open("deepseek2-f32"),
        rope__scaling__type="yarn",
        rope__scaling__factor=40.0,
        rope__scaling__original_context_length=4096,
        rope__scaling__yarn_log_multiplier=0.1,
    )
    hp = model_hparams(model)
    assert hp.rope.ext_factor == 1.0 and hp.rope.freq_scale == pytest.approx(1 / 40)
    assert hp.rope.attn_factor == pytest.approx(0.73051998, rel=1e-7)
    block = MLABlock(hp, TensorReader(model), 0)
    assert block.scale == pytest.approx(0.19124944, rel=1e-7)
    cos, sin = rope_cos_sin(hp.rope, np.arange(3))
    np.testing.assert_allclose(cos**2 + sin**2, 1.0, rtol=1e-6)  # rope_yarn cancels the 1/(1 + 0.1 ln 40)


def test_linear_scaling_scale() -> None:
    """Linear scaling by 4 (no YaRN, attn_factor 1): deepseek2.cpp's 1 + 0.1 ln 4 still enters kq_scale."""
    model = _with_metadata(_open("deepseek2-f32"), rope__scaling__type="linear", rope__scaling__factor=4.0)
    hp = model_hparams(model)
    assert hp.rope.freq_scale == 0.25 and hp.rope.ext_factor == 0.0
    block = MLABlock(hp, TensorReader(model), 0)
    assert block.scale == pytest.approx(0.13232113, rel=1e-7)  # 1.13862944^2 / 9.79795897


@pytest.mark.parametrize(
    ("name", "like"),
    [
        ("blk.0.attn_kv_b.weight", "blk.0.attn_output.weight"),  # next to attn_k_b / attn_v_b
        ("blk.0.attn_output.scale", "blk.0.attn_kv_a_norm.weight"),
    ],
)
def test_block_refuses_what_it_does_not_compute(name: str, like: str) -> None:
    model = _with_tensor(_open("deepseek2-f32"), name, like)
    with pytest.raises(UnsupportedTypeError, match=name.split(".", 2)[2]):
        MLABlock(model_hparams(model), TensorReader(model), 0)


# ----------------------------------------------------------------------------------------------
# old files with one attn_kv_b


def _legacy_copy(src: Path, dst: Path, *, nan_at: tuple[int, int] | None = None) -> Path:
    """``src`` as an old conversion writes it: one ``attn_kv_b`` per layer, no ``*_length_mla`` keys.

    attn_kv_b ``(H * (N + V), C)``: per head the no-RoPE key rows ``k_b[h].T`` then the value rows
    ``v_b[h]`` (the layout convert_hf_to_gguf.py split into attn_k_b / attn_v_b).
    """
    model = open_model(src)
    get = _dequantized(model)
    n_layer = int(model.metadata["deepseek2.block_count"])
    add, drop = {}, []
    for il in range(n_layer):
        k_b, v_b = get(f"blk.{il}.attn_k_b.weight"), get(f"blk.{il}.attn_v_b.weight")
        assert k_b is not None and v_b is not None
        add[f"blk.{il}.attn_kv_b.weight"] = np.concatenate(
            [np.concatenate([k_b[h].T, v_b[h]]) for h in range(k_b.shape[0])]
        )
        drop += [f"blk.{il}.attn_k_b.weight", f"blk.{il}.attn_v_b.weight"]
    if nan_at is not None:
        add["blk.0.attn_kv_b.weight"][nan_at] = np.nan
    u32 = gguf.GGUFValueType.UINT32
    return rewrite(
        src,
        dst,
        drop=drop,
        add=add,
        drop_keys=("deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla"),
        metadata={"deepseek2.attention.key_length": (96, u32), "deepseek2.attention.value_length": (64, u32)},
    )


def test_old_attn_kv_b_file_runs_like_the_split_one(tmp_path: Path) -> None:
    """An old file (attn_kv_b, per-head key_length/value_length) gives the split file's logits, llama.cpp's greedy."""
    src = Path(_open("deepseek2-f32").path)
    legacy = _legacy_copy(src, tmp_path / "deepseek2-legacy.gguf")
    hp = MLAHParams.from_metadata("deepseek2", open_model(legacy).metadata)
    assert not hp.split_kv_b and (hp.key_length, hp.value_length, hp.nope_dims) == (96, 64, 64)
    assert "blk.0.attn_kv_b.weight" in hp.tensor_shapes(0) and "blk.0.attn_k_b.weight" not in hp.tensor_shapes(0)
    want = np.load(src.with_suffix(".forward.npz"))
    tokens = want["tokens"].tolist()

    async def main(path: Path) -> tuple[np.ndarray, list[int]]:
        async with aioexperts.load(path, slots=8, io=aioexperts.IOOptions(backend="threads")) as model:
            logits = await model.logits(tokens)
            greedy = [t async for t in model.generate(tokens, max_tokens=len(want["greedy"]))]
        return logits, greedy

    split_logits, _ = anyio.run(main, src)
    logits, greedy = anyio.run(main, legacy)
    # the same float32 weights multiplied by other routines (np.matmul per head against BLAS through
    # fused.linear): float32 noise, which flips a few F16 roundings of the latent KV cache (1.7e-4 measured)
    assert np.linalg.norm(logits - split_logits) / np.linalg.norm(split_logits) < 1e-3
    assert greedy == want["greedy"].tolist()


def test_split_kv_b_inverts_the_old_layout() -> None:
    rng = np.random.default_rng(7)
    hp = MLAHParams(
        n_embd=8, n_head=3, q_lora_rank=4, kv_lora_rank=5, key_length=6, value_length=7, rope_dims=2, rms_eps=1e-6,
        split_kv_b=False,
    )  # fmt: skip
    k_b = rng.standard_normal((3, 5, 4)).astype(np.float32)
    v_b = rng.standard_normal((3, 7, 5)).astype(np.float32)
    kv_b = np.concatenate([np.concatenate([k_b[h].T, v_b[h]]) for h in range(3)])
    assert kv_b.shape == hp.tensor_shapes(0)["blk.0.attn_kv_b.weight"]
    got_k, got_v = mla.split_kv_b(kv_b, hp)
    assert np.array_equal(got_k, k_b) and np.array_equal(got_v, v_b)


def test_old_attn_kv_b_with_nan_in_the_key_part_is_refused(tmp_path: Path) -> None:
    """The key rows are dequantized at load, so NaN there is refused then (rows 0..63 of head 0)."""
    legacy = open_model(_legacy_copy(Path(_open("deepseek2-f32").path), tmp_path / "nan.gguf", nan_at=(5, 3)))
    with pytest.raises(FormatError, match="NaN"):
        MLABlock(model_hparams(legacy), TensorReader(legacy), 0)
