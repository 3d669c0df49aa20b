"""Qwen3.5-MoE (``qwen35moe``) end to end against llama.cpp: gated delta net + gated full attention.

The fixtures (``next-archs/qwen35moe-*.gguf``, their README) were run by llama.cpp; the bounds are the
README's: an exact float32 implementation is 5.7e-7 off the F32-KV golden, 2.0e-4 off the default one
(llama.cpp's F16 K/V and flash attention), 4.1e-2 (argmax equal at 60 of 64) off the Q4_K_M one.
The recurrent state per sequence (conv inputs and per-head delta-rule matrices) is checked through
the sequence API: prefix reuse (``keep``, chat), failed calls, cancellation, several sequences.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import gguf
import numpy as np
import pytest
from conftest import rel_l2, shared_fixture_paths
from gguf_rewrite import rewrite

import aioexperts
from aioexperts._compute import fused
from aioexperts._compute.norms import rms_norm
from aioexperts._model.kvcache import KVCache
from aioexperts._model.qwen35_blocks import GatedAttentionBlock, GatedDeltaNetBlock

THREADS = aioexperts.IOOptions(backend="threads")
_BY_STEM = {p.stem: p for p in shared_fixture_paths() if p.stem.startswith("qwen35moe-")}
pytestmark = pytest.mark.skipif(
    not {"qwen35moe-f32", "qwen35moe-q4_k_m"} <= set(_BY_STEM), reason="no qwen35moe fixtures"
)


def fixture(stem: str) -> Path:
    return _BY_STEM[stem]


def golden(stem: str, suffix: str = ".forward.npz") -> Any:
    path = fixture(stem)
    return np.load(path.with_name(path.stem + suffix))


@functools.cache
def run(stem: str, precision: str | None, kv_type: str = "f16") -> dict[str, Any]:
    """Prompt logits (one batch) and greedy continuation of the fixture ``stem`` at ``precision``."""
    want = golden(stem)
    tokens = want["tokens"].tolist()

    async def main() -> dict[str, Any]:
        async with aioexperts.load(fixture(stem), slots=16, io=THREADS, kv_type=kv_type) as model:  # type: ignore[arg-type]
            logits = await model.logits(tokens)
            greedy = [t async for t in model.generate(tokens, max_tokens=len(want["greedy"]))]
        return {"logits": logits, "greedy": greedy}

    fused.set_precision(precision)  # type: ignore[arg-type]
    try:
        return anyio.run(main)
    finally:
        fused.set_precision(None)


def test_f32_file_in_float_precision_matches_the_f32_kv_golden() -> None:
    want = golden("qwen35moe-f32", ".forward-f32kv.npz")
    got = run("qwen35moe-f32", "float", "f32")
    assert rel_l2(got["logits"], want["logits"]) <= 1e-4
    assert got["greedy"] == want["greedy"].tolist()


def test_f32_file_with_default_settings_matches_the_default_golden() -> None:
    want = golden("qwen35moe-f32")
    got = run("qwen35moe-f32", None)
    assert rel_l2(got["logits"], want["logits"]) <= 3e-3
    assert got["greedy"] == want["greedy"].tolist()


def test_q4_k_m_file_with_default_settings_is_within_llama_cpp_s_activation_rounding() -> None:
    want = golden("qwen35moe-q4_k_m")
    got = run("qwen35moe-q4_k_m", None)
    assert rel_l2(got["logits"], want["logits"]) <= 5e-2
    assert int((got["logits"].argmax(1) == want["logits"].argmax(1)).sum()) >= 60


@pytest.mark.parametrize(
    ("stem", "suffix", "bound"),
    [("qwen35moe-f32", ".forward-f32kv.npz", 1e-5), ("qwen35moe-q4_k_m", ".forward.npz", 3e-2)],
)
def test_every_block_fed_llama_cpp_s_input_matches_its_output(stem: str, suffix: str, bound: float) -> None:
    """Each attention block from ``attn_norm-L`` (``gdn_out-L`` and ``attn_out-L``), each FFN from
    ``ffn_inp-L`` (``ffn_out-L``): the README measured 1e-7..4e-7 (F32, F32 KV) and 1.3-2.3 % (Q4_K_M,
    float activations) per block."""
    want = golden(stem, suffix)

    async def main() -> dict[str, float]:
        errors: dict[str, float] = {}
        async with aioexperts.load(fixture(stem), slots=16, io=THREADS) as model:
            hp, w = model.hparams, model.forward_pass.weights
            kinds = set()
            for layer in w.layers:
                il, block = layer.index, layer.block
                states = [dict(block.state_shapes())] if isinstance(block, GatedDeltaNetBlock) else [{}]
                kv_type = "f32" if suffix == ".forward-f32kv.npz" else "f16"
                cache = KVCache([dict(block.cache_shapes())], len(want["tokens"]), states, kv_type).layer(0)
                x = want[f"attn_norm-{il}"]
                if isinstance(block, GatedDeltaNetBlock):
                    errors[f"gdn_out-{il}"] = rel_l2(block.delta_output(x, cache, 0)[0], want[f"gdn_out-{il}"])
                    cache = KVCache([{}], len(x), states).layer(0)
                kinds.add(type(block))
                errors[f"attn_out-{il}"] = rel_l2(block.attention(x, cache, 0), want[f"attn_out-{il}"])
                ffn_in = rms_norm(want[f"ffn_inp-{il}"], layer.ffn_norm, hp.norm_eps)
                errors[f"ffn_out-{il}"] = rel_l2(await model.runner.moe(il, ffn_in), want[f"ffn_out-{il}"])
            assert kinds == {GatedDeltaNetBlock, GatedAttentionBlock}
        return errors

    fused.set_precision("float")
    try:
        errors = anyio.run(main)
    finally:
        fused.set_precision(None)
    assert len(errors) == 4 * 2 + 2
    assert max(errors.values()) <= bound, errors


def test_q4_k_m_blocks_one_row_at_a_time_at_int8_precision_are_llama_cpp_s() -> None:
    """llama.cpp quantizes the activations before every quantized product; the int8 one-row kernels
    do the same, which makes each gated delta net block (no F16 KV cache in it) llama.cpp's to float
    noise (measured 4e-7) and each full attention block its F16-KV rounding (measured 3e-3)."""
    stem = "qwen35moe-q4_k_m"
    want = golden(stem)
    n = len(want["tokens"])

    async def main() -> dict[str, float]:
        errors: dict[str, float] = {}
        async with aioexperts.load(fixture(stem), slots=16, io=THREADS) as model:
            for layer in model.forward_pass.weights.layers:
                block = layer.block
                if not {m.ggml_type for m in vars(block).values() if hasattr(m, "ggml_type")} <= fused.int8_types():
                    pytest.skip("the int8 kernels are not available here")
                states = [dict(block.state_shapes())] if isinstance(block, GatedDeltaNetBlock) else [{}]
                cache = KVCache([dict(block.cache_shapes())], n, states).layer(0)
                x = want[f"attn_norm-{layer.index}"]
                got = np.concatenate([block.attention(x[t : t + 1], cache, t) for t in range(n)])
                errors[f"{type(block).__name__}-{layer.index}"] = rel_l2(got, want[f"attn_out-{layer.index}"])
        return errors

    fused.set_precision("int8")
    try:
        errors = anyio.run(main)
    finally:
        fused.set_precision(None)
    assert len(errors) == 4
    for name, error in errors.items():
        assert error <= (1e-5 if name.startswith("GatedDeltaNet") else 5e-3), errors


async def _logits_of(model: aioexperts.Model, tokens: list[int]) -> np.ndarray:
    async with model.sequence() as seq:
        return await seq.forward(tokens)


@pytest.mark.anyio
async def test_keep_of_a_shorter_prefix_runs_it_again_and_equals_a_fresh_prefill(anyio_backend: object) -> None:
    tokens = golden("qwen35moe-f32")["tokens"].tolist()
    # a float32 KV cache: other batch sizes' float noise would flip F16 roundings (3.8e-5 measured)
    async with aioexperts.load(fixture("qwen35moe-f32"), slots=16, io=THREADS, kv_type="f32") as model:
        fresh = await _logits_of(model, tokens[:48])
        async with model.sequence() as seq:
            assert not seq.rewinds
            await seq.forward(tokens[:40])
            seq.keep(20)
            assert seq.n_past == 20
            again = await seq.forward(tokens[20:48])
            assert seq.n_past == 48 and seq.tokens == tokens[:48]
            nxt = await seq.forward(tokens[48:50])
        longer = await _logits_of(model, tokens[:50])
    assert again.tobytes() == fresh[20:48].tobytes()  # the same one batch of 48 tokens
    assert rel_l2(nxt, longer[48:50]) <= 1e-5  # the state carried on (other batch sizes: float noise)


@pytest.mark.anyio
async def test_a_failed_call_leaves_the_sequence_usable_with_the_same_numbers(anyio_backend: object) -> None:
    """A call that fails after the first gated delta net advanced its state (a block of layer 2
    raising) must not leave that state behind: the next call re-runs the kept tokens."""
    tokens = golden("qwen35moe-f32")["tokens"].tolist()
    async with aioexperts.load(fixture("qwen35moe-f32"), slots=16, io=THREADS) as model:
        fresh = await _logits_of(model, tokens[:30])
        block = model.forward_pass.weights.layers[2].block
        async with model.sequence() as seq:
            await seq.forward(tokens[:10])
            with pytest.MonkeyPatch.context() as mp:

                def broken(*args: object) -> np.ndarray:
                    raise aioexperts.NonFiniteError("injected")

                mp.setattr(block, "attention", broken)
                with pytest.raises(aioexperts.NonFiniteError, match="injected"):
                    await seq.forward(tokens[10:20])
            assert seq.n_past == 10
            got = await seq.forward(tokens[10:30])
    assert got.tobytes() == fresh[10:30].tobytes()


def test_the_kv_estimate_counts_the_full_attention_layers_only() -> None:
    """kv_bytes_per_position (before the blocks are built) equals what the built blocks cache."""
    from aioexperts._format.architectures import model_hparams
    from aioexperts._model.memory import kv_bytes_per_position

    gguf = aioexperts.open_model(fixture("qwen35moe-f32"))
    hp = model_hparams(gguf)
    assert kv_bytes_per_position(hp, gguf) == 2 * 2 * hp.n_head_kv * (hp.head_k + hp.head_v)  # layers 1 and 3, F16

    async def main() -> int:
        async with aioexperts.load(fixture("qwen35moe-f32"), slots=16, io=THREADS) as model:
            return model.statistics().kv_bytes_per_position

    assert anyio.run(main) == kv_bytes_per_position(hp, gguf)


@pytest.mark.anyio
async def test_a_cancelled_generation_frees_its_recurrent_state(anyio_backend: object) -> None:
    tokens = golden("qwen35moe-f32")["tokens"].tolist()
    async with aioexperts.load(fixture("qwen35moe-f32"), slots=16, io=THREADS) as model:
        assert model._state_bytes == 2 * 4 * (3 * 512 + 4 * 64 * 64)  # two gated delta net layers
        seq = model.sequence()
        stats = model.statistics()
        assert stats.kv_bytes_in_use == model.n_ctx * stats.kv_bytes_per_position + model._state_bytes
        seq.close()
        gen = model.generate(tokens[:16], max_tokens=50)
        with anyio.move_on_after(30) as scope:
            async for _ in gen:
                scope.cancel()
        assert scope.cancelled_caught
        stats = model.statistics()
        assert stats.live_sequences == 0 and stats.kv_bytes_in_use == 0
        assert gen._seq is None


@pytest.mark.anyio
async def test_two_interleaved_sequences_each_get_what_they_get_alone(anyio_backend: object) -> None:
    tokens = golden("qwen35moe-f32")["tokens"].tolist()
    a, b = tokens[:12], tokens[20:32]
    # a float32 KV cache: other batch sizes' float noise would flip F16 roundings
    async with aioexperts.load(fixture("qwen35moe-f32"), slots=16, io=THREADS, batch_wait=0, kv_type="f32") as model:
        alone_a, alone_b = await _logits_of(model, a), await _logits_of(model, b)
        async with model.sequence() as sa, model.sequence() as sb:
            got_a = [await sa.forward(a[:4])]
            got_b = [await sb.forward(b[:4])]
            for t in range(4, 12):
                got_b.append(await sb.forward([b[t]]))
                got_a.append(await sa.forward([a[t]]))
    np.testing.assert_allclose(np.concatenate(got_a), alone_a, rtol=0, atol=2e-5 * np.abs(alone_a).max())
    np.testing.assert_allclose(np.concatenate(got_b), alone_b, rtol=0, atol=2e-5 * np.abs(alone_b).max())


# -- text: a copy of the F32 fixture with the built-in model's byte-level BPE vocabulary and ChatML


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from aioexperts.testing._full_model import CHATML_TEMPLATE, train_vocabulary

    n_vocab = int(golden("qwen35moe-f32")["logits"].shape[1])
    tokens, merges = train_vocabulary(n_vocab)
    types = [gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens]
    s, u32, arr = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.ARRAY
    return rewrite(
        fixture("qwen35moe-f32"),
        tmp_path_factory.mktemp("qwen35") / "qwen35moe-text.gguf",
        metadata={
            "tokenizer.ggml.model": ("gpt2", s),
            "tokenizer.ggml.pre": ("qwen35", s),
            "tokenizer.ggml.tokens": (tokens, arr),
            "tokenizer.ggml.token_type": ([int(t) for t in types], arr),
            "tokenizer.ggml.merges": (merges, arr),
            "tokenizer.ggml.eos_token_id": (tokens.index("<|im_end|>"), u32),
            "tokenizer.ggml.bos_token_id": (tokens.index("<|endoftext|>"), u32),
            "tokenizer.ggml.add_bos_token": (False, gguf.GGUFValueType.BOOL),
            "tokenizer.chat_template": (CHATML_TEMPLATE, s),
        },
    )


async def _fresh_reply(model: aioexperts.Model, messages: list[dict[str, Any]], n: int) -> tuple[str, int]:
    ids = model.apply_chat_template(messages, tokenize=True)
    assert isinstance(ids, list)
    return model.tokenizer.decode([t async for t in model.generate(ids, max_tokens=n)]), len(ids)


@pytest.mark.anyio
async def test_chat_turns_give_the_text_of_a_fresh_prefill(text_model: Path, anyio_backend: object) -> None:
    """A turn whose prompt extends the whole cache continues the recurrent state; one that does not
    (the history rewritten) prefills everything again; both give a fresh prefill's text."""
    async with aioexperts.load(text_model, slots=16, io=THREADS) as model:
        async with model.chat("You are terse.") as chat:
            first = "".join([p async for p in chat.send("Once upon a time", max_tokens=6)])
            cached = chat.n_past
            second = "".join([p async for p in chat.send("and then?", max_tokens=6)])
            extended = chat.statistics()
            want_second, _ = await _fresh_reply(model, chat.messages[:-1], 6)
            chat.messages = chat.messages[:1]  # only the system message: the cache holds more than that
            third = "".join([p async for p in chat.send("Something else", max_tokens=6)])
            rewritten = chat.statistics()
            want_third, n_third = await _fresh_reply(model, chat.messages[:-1], 6)
        streamed = "".join([p async for p in model.stream("Once upon a time", max_tokens=6)])
    assert first and streamed
    assert second == want_second and extended.reused_tokens == cached > 0
    assert third == want_third and rewritten.reused_tokens == 0 and rewritten.prefilled_tokens == n_third


def test_aioexperts_run_generates_text_from_it(text_model: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aioexperts.cli.run", str(text_model), "-p", "Once upon", "-n", "5", "--temp", "0"]
        + ["--io", "threads"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "Traceback" not in done.stderr


# -- bad input


@pytest.mark.parametrize(
    ("drop", "drop_key", "needle"),
    [
        ("blk.0.ssm_a", None, "blk.0.ssm_a"),
        ("blk.2.ssm_conv1d.weight", None, "blk.2.ssm_conv1d.weight"),
        ("blk.1.attn_q_norm.weight", None, "blk.1.attn_q_norm.weight"),
        ("blk.3.post_attention_norm.weight", None, "blk.3.post_attention_norm.weight"),
        (None, "qwen35moe.ssm.conv_kernel", "qwen35moe.ssm.conv_kernel"),
        (None, "qwen35moe.ssm.state_size", "qwen35moe.ssm.state_size"),
    ],
)
def test_a_missing_tensor_or_key_is_refused_at_load_by_name(
    tmp_path: Path, drop: str | None, drop_key: str | None, needle: str
) -> None:
    bad = rewrite(
        fixture("qwen35moe-f32"),
        tmp_path / "bad.gguf",
        drop=[drop] if drop else [],
        drop_keys=[drop_key] if drop_key else [],
    )

    async def main() -> None:
        async with aioexperts.load(bad, slots=16, io=THREADS):
            pass

    with pytest.raises(aioexperts.FormatError, match=needle.replace(".", r"\.")):
        anyio.run(main)
