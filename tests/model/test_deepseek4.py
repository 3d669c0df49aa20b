"""deepseek4 (DeepSeek-V4) against llama.cpp, piece by piece and whole (shared/fixtures/next-archs).

Hyper-connections and attention blocks are fed llama.cpp's captured block inputs; the whole model
runs through :func:`aioexperts.load`. The fixture README measured an exact float64 recomputation at
1e-7..4e-7 per hyper-connection, 3.5e-4 per attention block against the default goldens (F16 K/V, flash
attention: a float32 cache), 1.3-2.3 % per block of the Q4_K_M file (float activations), 6.1e-6 at the
logits against the F32-KV golden. With the keys and compressed rows rounded to F16 as llama.cpp's
caches keep them (``DSV4Block.f16_cache``) and llama.cpp's activation quantization, an attention block
is 1.3e-5..2.6e-5 from the default F32 golden and 1.1e-3..2.1e-3 from the Q4_K_M one (measured).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import anyio
import gguf
import numpy as np
import pytest
from conftest import rel_l2
from gguf_rewrite import rewrite

import aioexperts
from aioexperts._compute.hyper import hc_coefficients, hc_head_weights, hc_post, hc_pre
from aioexperts._format.architectures import model_hparams
from aioexperts._format.model import open_model
from aioexperts._model.dsv4_block import DSV4Block, dsv4_cache_shapes
from aioexperts._model.hyper_weights import MAX_SINKHORN_ITERATIONS
from aioexperts._model.kvcache import KVCache
from aioexperts._model.memory import kv_bytes_per_position
from aioexperts._model.weights import TensorReader

DIR = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "next-archs"
if not DIR.exists():
    DIR = Path("/work/shared/fixtures/next-archs")
F32 = DIR / "deepseek4-f32.gguf"
Q4 = DIR / "deepseek4-q4_k_m.gguf"
THREADS = aioexperts.IOOptions(backend="threads")

pytestmark = pytest.mark.skipif(not F32.exists(), reason="shared next-archs fixtures not found")


def golden(path: Path, kind: str = "forward") -> Any:
    return np.load(path.with_name(f"{path.stem}.{kind}.npz"))


@functools.cache
def reader_and_hparams(path: Path) -> tuple[TensorReader, Any]:
    model = open_model(path)
    return TensorReader(model), model_hparams(model)


def new_cache(block: DSV4Block, n_ctx: int = 512) -> dict[str, np.ndarray]:
    return KVCache([block.cache_shapes()], n_ctx, kv_type="f32").layer(0)  # as the model keeps it (kv_float32)


# -- hyper-connections ------------------------------------------------------------------------------


def test_hyper_connections_match_llama_cpp() -> None:
    r, hp = reader_and_hparams(F32)
    want = golden(F32, "forward-f32kv")
    streams = np.repeat(r.matrix("token_embd.weight").rows(want["tokens"])[:, None], 4, axis=1)
    errors = {}
    for il in range(hp.n_layer):
        for kind, x, out, pre_key, post_key in (
            ("attn", streams, want[f"attn_out-{il}"], f"hc_attn_pre-{il}", f"ffn_inp-{il}"),
            ("ffn", want[f"ffn_inp-{il}"], want[f"ffn_out-{il}"], f"hc_ffn_pre-{il}", f"l_out-{il}"),
        ):
            p = f"blk.{il}.hc_{kind}_"
            mix = hc_coefficients(
                x,
                r.matrix(p + "fn.weight"),
                r.array(p + "scale.weight"),
                r.array(p + "base.weight"),
                iterations=5,
                eps=1e-6,
                norm_eps=hp.norm_eps,
            )
            errors[pre_key] = rel_l2(hc_pre(x, mix.pre), want[pre_key])
            errors[post_key] = rel_l2(hc_post(out, x, mix), want[post_key])
        streams = want[f"l_out-{il}"]
    head = hc_head_weights(
        streams, r.matrix("output_hc_fn.weight"), r.array("output_hc_scale.weight"), r.array("output_hc_base.weight"),
        1e-6, hp.norm_eps,
    )  # fmt: skip
    errors["hc_head"] = rel_l2(hc_pre(streams, head), want["hc_head"])
    assert len(errors) == 4 * 4 + 1
    assert max(errors.values()) <= 1e-6, errors


# -- attention blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kind", "bound"),
    [(F32, "forward-f32kv", 1e-5), (F32, "forward", 6e-5), (Q4, "forward", 5e-3)],
    ids=["f32-f32kv", "f32-default", "q4_k_m-forced-rows"],
)
def test_attention_blocks_match_llama_cpp(path: Path, kind: str, bound: float) -> None:
    """``attn_norm-L`` -> ``attn_out-L``; the Q4_K_M file with llama.cpp's indexer choices forced
    (``lid_top_k``). Against the default goldens the keys and rows are F16 values, as in llama.cpp's
    caches: kept in float32 instead, the blocks are 3.4e-4 (F32) and 7e-3 (Q4_K_M) off (measured).
    The Q4_K_M blocks' 1.1e-3..1.9e-3 over all positions is float32 noise that flips an 8-bit
    activation step at some positions (1e-3..1.5e-2 there); at the others the block is llama.cpp's to
    float32 noise (measured: median position 4.4e-7..6.1e-7, 214..234 of 250 positions within 1e-5)."""
    r, hp = reader_and_hparams(path)
    want = golden(path, kind)
    ratios = []
    for il in range(hp.n_layer):
        block = DSV4Block(hp, r, il)
        block.f16_cache = kind == "forward"  # the F32-KV run keeps everything in F32
        ratios.append(block.ratio)
        forced = path == Q4 and block.index is not None
        picks = [np.asarray(p) for p in want[f"lid_top_k-{il}"]] if forced else None
        got = block.run(want[f"attn_norm-{il}"], new_cache(block), 0, picks=picks)
        assert rel_l2(got, want[f"attn_out-{il}"]) <= bound, il
        if path == Q4:
            per_position = np.array([rel_l2(g, w) for g, w in zip(got, want[f"attn_out-{il}"], strict=True)])
            assert np.median(per_position) <= 2e-6 and (per_position <= 1e-5).sum() >= 200, il
    assert ratios == [0, 4, 128, 4]  # window only, CSA, HCA, CSA


@pytest.mark.parametrize("kind", ["forward-f32kv", "forward"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunks"])
def test_indexer_picks_llama_cpp_s_rows(kind: str, chunked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CSA layers' chosen rows equal llama.cpp's at every position (the default golden's near-ties
    fall the same way with the index rows rotated and kept in F16, as llama.cpp keeps them)."""
    r, hp = reader_and_hparams(F32)
    want = golden(F32, kind)
    n = len(want["tokens"])
    if chunked:  # a long prefill's scores go in chunks of queries: 7 queries of 16 heads x 62 rows
        monkeypatch.setattr("aioexperts._model.dsv4_block.INDEX_SCORE_FLOATS", 7 * 16 * 62)
    for il in (1, 3):
        block = DSV4Block(hp, r, il)
        block.f16_cache = kind == "forward"  # the F32-KV run keeps its index rows in F32
        capture: dict[str, np.ndarray] = {}
        block.run(want[f"attn_norm-{il}"], new_cache(block), 0, capture=capture)
        scores = capture["lid_scores"]
        theirs = want[f"lid_scores-{il}"][:, : scores.shape[1]]
        assert np.array_equal(np.isfinite(scores), np.isfinite(theirs))
        finite = np.isfinite(theirs)
        assert rel_l2(scores[finite], theirs[finite]) <= (5e-5 if block.f16_cache else 5e-6)
        visible = (np.arange(n) + 1) // 4
        for t in range(n):
            ours = np.sort(np.argsort(-scores[t, : visible[t]], kind="stable")[:8])
            llama = np.sort(want[f"lid_top_k-{il}"][t][want[f"lid_top_k-{il}"][t] < visible[t]])
            assert np.array_equal(ours, llama), (il, t)


def test_block_prefill_equals_token_by_token_with_rows_finished_across_calls() -> None:
    """Every block run one position per call (each compressed row finished from inputs kept by earlier
    calls) gives what one batch gives, to float noise; and in chunks that split rows the same."""
    r, hp = reader_and_hparams(F32)
    want = golden(F32, "forward-f32kv")
    for il in range(hp.n_layer):
        block = DSV4Block(hp, r, il)
        block.f16_cache = False  # float32 caches: F16 roundings would flip on the float noise
        x = want[f"attn_norm-{il}"]
        batch = block.run(x, new_cache(block), 0)
        cache = new_cache(block)
        steps = np.concatenate([block.run(x[i : i + 1], cache, i) for i in range(len(x))])
        cache = new_cache(block)
        cuts = [0, 3, 130, 131, 250]  # mid CSA block, past HCA row 0, one lone position
        chunks = np.concatenate([block.run(x[a:b], cache, a) for a, b in zip(cuts, cuts[1:], strict=False)])
        assert rel_l2(steps, batch) <= 1e-5 and rel_l2(chunks, batch) <= 1e-5, il


# -- the whole model --------------------------------------------------------------------------------


@functools.cache
def whole_f32kv() -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        want = golden(F32, "forward-f32kv")
        tokens = want["tokens"].tolist()
        async with aioexperts.load(F32, slots=8, io=THREADS, kv_type="f32") as model:
            async with model.sequence() as seq:
                logits = await seq.forward(tokens)
            greedy = [t async for t in model.generate(tokens, max_tokens=len(want["greedy"]))]
        return {"logits": logits, "greedy": greedy}

    return anyio.run(main)


def test_whole_model_matches_llama_cpp_f32_kv() -> None:
    want = golden(F32, "forward-f32kv")
    got = whole_f32kv()
    assert rel_l2(got["logits"], want["logits"]) <= 1e-4
    assert (got["logits"].argmax(axis=1) == want["logits"].argmax(axis=1)).all()


def test_greedy_continuation_crosses_a_compressed_row_completion() -> None:
    """Positions 250-259: HCA row 1 completes at 255 from compressor inputs kept across decode calls."""
    want = golden(F32, "forward-f32kv")
    assert whole_f32kv()["greedy"] == want["greedy"].tolist()


def test_keep_then_new_tokens_equal_a_fresh_prefill() -> None:
    """``keep(n)`` inside a CSA block (its row not finished) and past HCA row 0, then other tokens: the
    unfinished rows are made again from the new positions, as in a fresh prefill of the same tokens."""
    tokens = golden(F32)["tokens"].tolist()
    other = [(t * 7 + 3) % 512 for t in tokens[130:140]]

    async def main() -> tuple[np.ndarray, np.ndarray]:
        # a float32 KV cache: other batch sizes' float noise would flip F16 roundings (4.7e-5 measured)
        async with aioexperts.load(F32, slots=8, io=THREADS, kv_type="f32") as model:
            async with model.sequence() as seq:
                await seq.forward(tokens[:200])
                seq.keep(130)
                kept = await seq.forward(other)
            async with model.sequence() as seq:
                fresh = (await seq.forward(tokens[:130] + other))[130:]
        return kept, fresh

    kept, fresh = anyio.run(main)
    assert rel_l2(kept, fresh) <= 1e-5


def test_a_cancelled_generation_frees_its_cache_and_compressor_state() -> None:
    tokens = golden(F32)["tokens"].tolist()[:40]

    async def main() -> tuple[Any, Any, int]:
        async with aioexperts.load(F32, slots=8, io=THREADS) as model:
            per_position = model.statistics().kv_bytes_per_position
            got: list[int] = []

            async def run() -> None:
                async for t in model.generate(tokens, max_tokens=50):
                    got.append(t)  # noqa: PERF401  (seen one by one while it runs)

            with anyio.move_on_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run)
                    while len(got) < 3:
                        await anyio.sleep(0.01)
                    during = model.statistics()
                    tg.cancel_scope.cancel()
            return during, model.statistics(), per_position

    during, after, per_position = anyio.run(main)
    # kv, then per compressed layer its inputs and a 1/ratio share of a row, per CSA layer the indexer's
    assert per_position == 4 * (4 * 128 + (512 + 128 // 4 + 256 + 64 // 4) * 2 + (256 + 1))
    assert kv_bytes_per_position(reader_and_hparams(F32)[1]) == per_position  # the estimate before the blocks
    assert during.live_sequences == 1 and during.kv_bytes_in_use > 0
    assert after.live_sequences == 0 and after.kv_bytes_in_use == 0


# -- bad files --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drop", "drop_key", "named"),
    [
        ("output_hc_fn.weight", None, "output_hc_fn.weight"),
        ("blk.2.hc_ffn_base.weight", None, "blk.2.hc_ffn_base.weight"),
        ("blk.3.indexer_compressor_norm.weight", None, "blk.3.indexer_compressor_norm.weight"),
        ("blk.2.attn_compressor_ape.weight", None, "blk.2.attn_compressor_ape.weight"),
        ("blk.0.attn_output_a.weight", None, "blk.0.attn_output_a.weight"),
        (None, "deepseek4.attention.compress_ratios", "deepseek4.attention.compress_ratios"),
        (None, "deepseek4.hyper_connection.count", "deepseek4.hyper_connection.count"),
        (None, "deepseek4.attention.indexer.top_k", "deepseek4.attention.indexer.top_k"),
    ],
)
def test_a_file_missing_a_tensor_or_key_is_refused_at_load_with_its_name(
    tmp_path: Path, drop: str | None, drop_key: str | None, named: str
) -> None:
    bad = rewrite(F32, tmp_path / "bad.gguf", drop=[drop] if drop else (), drop_keys=[drop_key] if drop_key else ())

    async def main() -> None:
        async with aioexperts.load(bad, slots=8, io=THREADS):
            pass

    with pytest.raises(aioexperts.FormatError, match=named.replace(".", r"\.")):
        anyio.run(main)


def test_a_compress_ratio_other_than_0_4_128_is_refused(tmp_path: Path) -> None:
    ratios = (gguf.GGUFValueType.ARRAY, [0, 4, 64, 4])
    bad = rewrite(F32, tmp_path / "bad.gguf", metadata={"deepseek4.attention.compress_ratios": (ratios[1], ratios[0])})

    async def main() -> None:
        async with aioexperts.load(bad, slots=8, io=THREADS):
            pass

    with pytest.raises(aioexperts.FormatError, match="compress ratio 64 of block 2"):
        anyio.run(main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("iterations", [MAX_SINKHORN_ITERATIONS + 1, 2**32 - 1])
def test_a_sinkhorn_iteration_count_past_the_bound_is_refused_at_load(tmp_path: Path, iterations: int) -> None:
    # a corrupt count would otherwise run one Python step per iteration, per block and token
    key = "deepseek4.hyper_connection.sinkhorn_iterations"
    bad = rewrite(F32, tmp_path / "bad.gguf", metadata={key: (iterations, gguf.GGUFValueType.UINT32)})

    async def main() -> None:
        async with aioexperts.load(bad, slots=8, io=THREADS):
            pass

    with pytest.raises(aioexperts.FormatError, match=f"sinkhorn_iterations is {iterations}, more than"):
        anyio.run(main)


# -- text -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The F32 fixture with a 512-token byte-level BPE vocabulary (DeepSeek-V3/V4's pre-tokenizer) and
    a ChatML template: the fixture itself carries no tokenizer."""
    from aioexperts.testing._full_model import CHATML_TEMPLATE, CONTROL_TOKENS, train_vocabulary

    tokens, merges = train_vocabulary(512)
    assert len(tokens) == 512
    t = gguf.GGUFValueType
    keys = {
        "tokenizer.ggml.model": ("gpt2", t.STRING),
        "tokenizer.ggml.pre": ("deepseek-v3", t.STRING),
        "tokenizer.ggml.tokens": (tokens, t.ARRAY),
        "tokenizer.ggml.token_type": ([3 if x in CONTROL_TOKENS else 1 for x in tokens], t.ARRAY),
        "tokenizer.ggml.merges": (merges, t.ARRAY),
        "tokenizer.ggml.eos_token_id": (tokens.index("<|im_end|>"), t.UINT32),
        "tokenizer.ggml.bos_token_id": (tokens.index("<|endoftext|>"), t.UINT32),
        "tokenizer.ggml.add_bos_token": (False, t.BOOL),
        "tokenizer.chat_template": (CHATML_TEMPLATE, t.STRING),
    }
    return rewrite(F32, tmp_path_factory.mktemp("dsv4-text") / "deepseek4-text.gguf", metadata=keys)


def test_generate_stream_and_chat_reuse_give_the_fresh_prefill_s_text(with_tokenizer: Path) -> None:
    async def main() -> None:
        async with aioexperts.load(with_tokenizer, slots=8, io=THREADS) as model:
            prompt = "Once upon a time there was a model with compressed attention"
            ids = model.tokenizer.encode(prompt)
            by_ids = [t async for t in model.generate(ids, max_tokens=8, temperature=0)]
            by_text = [t async for t in model.generate(prompt, max_tokens=8, temperature=0)]
            streamed = "".join([p async for p in model.stream(prompt, max_tokens=8, temperature=0)])
            assert by_text == by_ids and len(by_ids) > 0
            assert streamed == model.tokenizer.decode(by_ids)
            greedy = aioexperts.SamplingOptions(temperature=0)
            async with model.chat(options=greedy) as chat:
                first = "".join([p async for p in chat.send("Hello there", max_tokens=5)])
                second = "".join([p async for p in chat.send("And then?", max_tokens=5)])
            messages = [
                {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": first},
                {"role": "user", "content": "And then?"},
            ]
            fresh_ids = model.apply_chat_template(messages, tokenize=True)
            fresh = [t async for t in model.generate(fresh_ids, max_tokens=5, temperature=0)]
            assert second == model.tokenizer.decode(fresh)
            assert model.statistics().live_sequences == 0

    anyio.run(main)


def test_aioexperts_run_generates_from_the_file(with_tokenizer: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # this checkout's aioexperts
    done = subprocess.run(
        [sys.executable, "-m", "aioexperts.cli.run", str(with_tokenizer), "-p", "Once upon", "-n", "4"]
        + ["--temp", "0", "--io", "threads"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "Traceback" not in done.stderr


def test_the_model_keeps_the_deepseek4_cache_in_float32() -> None:
    """deepseek4's cache arrays are float32 whatever the KV type (its compressor state is llama.cpp's
    F32 state); under the default F16 KV type the keys and compressed rows hold F16 values (llama.cpp's
    F16 caches), under ``kv_type="f32"`` full float32 values."""

    def f16_valued(a: np.ndarray) -> bool:
        return bool(np.array_equal(a, a.astype(np.float16).astype(np.float32)))

    async def main(kv_type: str) -> tuple[set[np.dtype[Any]], int, dict[str, bool]]:
        async with aioexperts.load(F32, slots=8, io=THREADS, n_ctx=64, kv_type=kv_type) as model:  # type: ignore[arg-type]
            async with model.sequence() as seq:
                await seq.forward(golden(F32)["tokens"].tolist()[:40])
                assert seq._cache is not None
                dtypes = {a.dtype for il in range(model.hparams.n_layer) for a in seq._cache.layer(il).values()}
                layer = seq._cache.layer(1)  # a CSA layer: 10 rows finished
                kinds = {name: f16_valued(layer[name][:40]) for name in layer}  # rows 0-9 are in the first 40
            return dtypes, model.statistics().kv_bytes_per_position, kinds

    dtypes, per_position, kinds = anyio.run(main, "f16")
    assert dtypes == {np.dtype(np.float32)}
    assert {name for name, f16 in kinds.items() if f16} == {"kv", "rows", "idx_rows"}, kinds
    assert set(kinds) == {"kv", "rows", "idx_rows", "comp_kv", "comp_score", "idx_kv", "idx_score"}
    dtypes32, per_position32, kinds32 = anyio.run(main, "f32")
    assert dtypes32 == dtypes and per_position32 == per_position and not any(kinds32.values()), kinds32
    r, hp = reader_and_hparams(F32)
    assert per_position == sum(4 * math.prod(s) for il in range(hp.n_layer) for s in dsv4_cache_shapes(hp, il).values())
