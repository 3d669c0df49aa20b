"""The library API of the whole model: sequences, generation, concurrency, and bad input."""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.lowlevel
import gguf
import numpy as np
import pytest
from conftest import rel_l2, shared_fixture_paths
from gguf_rewrite import rewrite

import aioexperts
from aioexperts._model.kvcache import KVCache

pytestmark = pytest.mark.anyio

THREADS = aioexperts.IOOptions(backend="threads")
QWEN3 = next((p for p in shared_fixture_paths() if p.stem == "qwen3moe-f32"), None)
needs_fixture = pytest.mark.skipif(QWEN3 is None, reason="shared fixtures not found")


def load(path: Path, **kw: object) -> aioexperts.Model:
    return aioexperts.load(path, slots=8, io=THREADS, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def forward() -> dict[str, np.ndarray]:
    assert QWEN3 is not None
    data = np.load(QWEN3.with_name(QWEN3.stem + ".forward.npz"))
    return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Copies of qwen3moe-f32 with one thing wrong (or changed)."""
    assert QWEN3 is not None
    d = tmp_path_factory.mktemp("broken")

    def nan(a: np.ndarray) -> np.ndarray:
        a = a.copy()
        a.flat[7] = np.nan
        return a

    return {
        "nan_head": rewrite(QWEN3, d / "nan_head.gguf", patch={"output.weight": nan}),
        "nan_norm": rewrite(QWEN3, d / "nan_norm.gguf", patch={"blk.1.attn_norm.weight": nan}),
        "no_output_norm": rewrite(QWEN3, d / "no_output_norm.gguf", drop={"output_norm.weight"}),
        "tied": rewrite(QWEN3, d / "tied.gguf", drop={"output.weight"}),
        "no_embd": rewrite(QWEN3, d / "no_embd.gguf", drop={"token_embd.weight"}),
        "vocab_only": rewrite(QWEN3, d / "vocab_only.gguf", keep_tensors=False),
        "qwen3next": rewrite(QWEN3, d / "qwen3next.gguf", arch="qwen3next"),
        "eos": rewrite(QWEN3, d / "eos.gguf", metadata={"tokenizer.ggml.eos_token_id": (0, gguf.GGUFValueType.UINT32)}),
    }


@needs_fixture
async def test_logits_generate_and_statistics(forward: dict[str, np.ndarray], anyio_backend: object) -> None:
    assert QWEN3 is not None
    tokens = forward["tokens"].tolist()
    async with load(QWEN3) as model:
        logits = await model.logits(tokens)
        assert logits.shape == (16, model.n_vocab) and logits.dtype == np.float32
        assert rel_l2(logits, forward["logits"]) <= 3e-3
        greedy = [t async for t in model.generate(tokens, max_tokens=8)]
        assert greedy == forward["greedy"].tolist() and all(type(t) is int for t in greedy)
        assert [t async for t in model.generate(tokens, max_tokens=0)] == []
        st = model.statistics()
        assert st.dense_bytes > 0 and st.kv_bytes_per_position == 3 * 2 * 2 * 64 * 2  # F16 K and V
        assert st.n_ctx == 128 and st.live_sequences == 0 and st.kv_bytes_in_use == 0
        assert st.attention_seconds > 0 and st.moe_seconds > 0 and st.head_seconds > 0


@needs_fixture
async def test_sequence_keeps_its_cache_and_a_prefix(forward: dict[str, np.ndarray], anyio_backend: object) -> None:
    assert QWEN3 is not None
    tokens = forward["tokens"].tolist()
    async with load(QWEN3) as model:
        full = await model.logits(tokens)
        async with model.sequence() as seq:
            first = await seq.forward(tokens[:10])
            rest = await seq.forward(tokens[10:])
            assert seq.n_past == 16 and seq.tokens == tokens
            # other batch sizes: float32 noise that flips a few F16 roundings of the KV cache (2e-4 measured)
            assert rel_l2(np.concatenate([first, rest]), full) <= 1e-3
            seq.keep(4)
            assert seq.n_past == 4
            again = await seq.forward(tokens[4:], all_logits=False)
            assert again.shape == (1, model.n_vocab) and rel_l2(again[0], full[-1]) <= 1e-3
            # a chat continuing the same sequence: generation after the cached prompt
            cont = [t async for t in seq.generate([], max_tokens=3)]
            assert cont == forward["greedy"][:3].tolist()
            with pytest.raises(aioexperts.InvalidRequestError):
                seq.keep(seq.n_past + 1)
        assert seq.closed
        with pytest.raises(aioexperts.InvalidRequestError, match="closed"):
            await seq.forward([1])


@needs_fixture
async def test_bad_token_ids_are_refused_before_any_expert_read(anyio_backend: object) -> None:
    assert QWEN3 is not None
    async with load(QWEN3, n_ctx=8) as model:
        assert model.n_ctx == 8
        for bad in ([], [64], [-1], [1, 2.0], [True], "abc", None):
            with pytest.raises(aioexperts.InvalidRequestError):
                await model.logits(bad)  # type: ignore[arg-type]
        with pytest.raises(aioexperts.ContextLengthError, match="n_ctx=8"):
            await model.logits(list(range(9)))
        with pytest.raises(aioexperts.InvalidRequestError):
            [t async for t in model.generate([1], max_tokens=-1)]
        with pytest.raises(aioexperts.InvalidRequestError):
            [t async for t in model.generate([1], max_tokens=2, temperature=-1.0)]
        assert model.store.statistics().requests == 0  # nothing was read for any of them
        assert model.statistics().live_sequences == 0
        # a generation that fills n_ctx stops there, without an error: prompt plus tokens take n_ctx
        gen = model.generate([1, 2, 3, 4, 5], max_tokens=10)
        got = [t async for t in gen]
        assert len(got) == 3 and gen.stop_reason == "length"
        assert model.statistics().live_sequences == 0


@needs_fixture
async def test_sampler_is_pluggable(forward: dict[str, np.ndarray], anyio_backend: object) -> None:
    assert QWEN3 is not None
    tokens = forward["tokens"].tolist()
    seen: list[tuple[tuple[int, ...], int]] = []

    def second_best(logits: np.ndarray, history: object) -> int:
        assert logits.shape == (64,) and logits.dtype == np.float32
        seen.append((tuple(history), int(np.argmax(logits))))  # type: ignore[arg-type]
        return int(np.argsort(logits)[-2])

    async with load(QWEN3) as model:
        got = [t async for t in model.generate(tokens, max_tokens=3, sampler=second_best)]
        assert len(got) == 3 and seen[0] == (tuple(tokens), forward["greedy"][0])
        assert seen[1][0] == (*tokens, got[0]) and got[0] != forward["greedy"][0]
        with pytest.raises(aioexperts.InvalidRequestError, match="sampler returned"):
            [t async for t in model.generate(tokens, max_tokens=2, sampler=lambda lg, h: 64)]
        a = [t async for t in model.generate(tokens, max_tokens=6, temperature=1.0, seed=5)]
        b = [t async for t in model.generate(tokens, max_tokens=6, temperature=1.0, seed=5)]
        assert a == b and len(a) == 6


@needs_fixture
async def test_generation_stops_at_the_end_of_generation_id(
    broken: dict[str, Path], forward: dict[str, np.ndarray], anyio_backend: object
) -> None:
    tokens = forward["tokens"].tolist()
    greedy = forward["greedy"].tolist()
    assert 0 not in greedy[:8]

    def pick_zero_third(logits: np.ndarray, history: object) -> int:
        return 0 if len(history) == len(tokens) + 2 else int(np.argmax(logits))  # type: ignore[arg-type]

    async with load(broken["eos"]) as model:
        assert model.hparams.eog_ids == frozenset({0})
        got = [t async for t in model.generate(tokens, max_tokens=8, sampler=pick_zero_third)]
        assert got == greedy[:2]


@needs_fixture
async def test_two_concurrent_generations_and_a_cancelled_one(
    forward: dict[str, np.ndarray], anyio_backend: object
) -> None:
    assert QWEN3 is not None
    tokens = forward["tokens"].tolist()
    other = tokens[::-1]
    async with load(QWEN3) as model:
        alone_a = [t async for t in model.generate(tokens, max_tokens=6)]
        alone_b = [t async for t in model.generate(other, max_tokens=6)]
        results: dict[str, list[int]] = {}
        made: list[aioexperts.ModelSequence] = []
        caches: list[KVCache] = []
        plain_sequence = model.sequence

        def recorded() -> aioexperts.ModelSequence:
            made.append(plain_sequence())
            assert made[-1]._cache is not None
            caches.append(made[-1]._cache)
            return made[-1]

        model.sequence = recorded  # type: ignore[method-assign]

        async def gen(name: str, ids: list[int]) -> None:
            results[name] = [t async for t in model.generate(ids, max_tokens=6)]

        async def cancelled() -> None:
            with anyio.CancelScope() as scope:
                async for _ in model.generate(tokens, max_tokens=50):
                    scope.cancel()  # cancelled while the next token computes
            results["cancelled"] = []

        async with anyio.create_task_group() as tg:
            tg.start_soon(gen, "a", tokens)
            tg.start_soon(gen, "b", other)
            tg.start_soon(cancelled)
        assert results["a"] == alone_a and results["b"] == alone_b and results["cancelled"] == []
        assert len(made) == 3 and all(seq.closed for seq in made)
        assert all(cache.layers is None for cache in caches)  # the arrays are dropped, not just unlisted
        st = model.statistics()
        assert st.live_sequences == 0 and st.kv_bytes_in_use == 0
        assert [t async for t in model.generate(tokens, max_tokens=2)] == alone_a[:2]  # still usable


@needs_fixture
async def test_tied_output_head(broken: dict[str, Path], forward: dict[str, np.ndarray], anyio_backend: object) -> None:
    async with load(broken["tied"]) as model:
        assert (
            model.forward_pass.weights is not None
            and model.forward_pass.weights.output is model.forward_pass.weights.embedding
        )
        seq = model.sequence()
        capture: dict[str, np.ndarray] = {}
        assert seq._cache is not None
        logits = await seq.forward(forward["tokens"].tolist(), capture=capture)
        seq.close()
        table = model.forward_pass.weights.embedding.rows(list(range(model.n_vocab)))
        np.testing.assert_allclose(logits, capture["result_norm"] @ table.T, rtol=1e-4, atol=1e-5)


@needs_fixture
@pytest.mark.parametrize(
    ("case", "error", "needle"),
    [
        ("no_output_norm", aioexperts.FormatError, "output_norm.weight"),
        ("no_embd", aioexperts.FormatError, "token_embd.weight"),
        ("vocab_only", aioexperts.FormatError, "holds no tensors"),
        ("nan_norm", aioexperts.FormatError, "NaN"),
    ],
)
async def test_broken_files_are_refused_at_load(
    broken: dict[str, Path], case: str, error: type[Exception], needle: str, anyio_backend: object
) -> None:
    with pytest.raises(error, match=needle):
        async with load(broken[case]):
            pass


async def test_a_vocabulary_only_or_moe_only_file_says_what_it_is(tmp_path: Path, anyio_backend: object) -> None:
    from conftest import shared_vocab_paths

    from aioexperts.testing import SyntheticSpec, write_synthetic_model

    moe_only = tmp_path / "moe-only.gguf"
    write_synthetic_model(moe_only, SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2))
    cases = [(moe_only, "MoE layers only")] + [(p, "holds no tensors") for p in shared_vocab_paths()[:2]]
    for path, needle in cases:  # qwen2 is an architecture without a record: the file's kind is said first
        with pytest.raises(aioexperts.FormatError, match=needle) as err:
            async with load(path):
                pass
        assert str(path) in str(err.value)


@needs_fixture
async def test_nan_logits_raise_and_leave_the_model_usable(
    broken: dict[str, Path], forward: dict[str, np.ndarray], anyio_backend: object
) -> None:
    async with load(broken["nan_head"]) as model:
        with pytest.raises(aioexperts.NonFiniteError, match="logits"):
            await model.logits(forward["tokens"].tolist())
        assert model.statistics().live_sequences == 0


@needs_fixture
async def test_unsupported_architecture_is_refused_before_the_store_opens(
    broken: dict[str, Path], anyio_backend: object
) -> None:
    model = load(broken["qwen3next"])  # a MoE arch the store could open, without a whole-model record
    try:
        with pytest.raises(aioexperts.UnsupportedTypeError, match="qwen3next.*supported: "):
            await model.start()
        assert model._store is None
    finally:
        await model.aclose()


async def test_load_arguments_are_checked(anyio_backend: object) -> None:
    for kw in ({"n_ctx": 0}, {"n_ctx": 2.5}, {"memory_budget": 0}, {"resident_embedding_bytes": "x"}):
        with pytest.raises(aioexperts.ConfigError):
            aioexperts.load("x.gguf", **kw)  # type: ignore[arg-type]
    model = aioexperts.load("x.gguf")
    with pytest.raises(aioexperts.StoreClosedError, match="not started"):
        await model.logits([1])


@needs_fixture
async def test_embeddings_through_store_rows_and_n_ctx_from_the_budget(
    forward: dict[str, np.ndarray], anyio_backend: object, caplog: pytest.LogCaptureFixture
) -> None:
    assert QWEN3 is not None
    tokens = forward["tokens"].tolist()
    per_position = 3 * 2 * 2 * 64 * 2  # layers x (k, v) x KV heads x head size x float16
    with caplog.at_level("INFO", logger="aioexperts"):
        async with load(QWEN3, resident_embedding_bytes=0, memory_budget=40 * per_position) as model:
            assert model.n_ctx == 40  # the file says 128; the budget allows 40
            assert not model.statistics().embedding_resident
            logits = await model.logits(tokens)
            assert model.store.row_statistics() is not None  # the rows came through the store
    assert rel_l2(logits, forward["logits"]) <= 3e-3
    assert [r.getMessage() for r in caplog.records if "n_ctx = 40" in r.getMessage()]
    with pytest.raises(aioexperts.ConfigError, match="memory_budget"):
        async with load(QWEN3, n_ctx=64, memory_budget=40 * per_position):
            pass


@needs_fixture
async def test_keep_while_a_forward_runs_is_refused_and_the_sequence_stays_whole(
    forward: dict[str, np.ndarray], anyio_backend: object
) -> None:
    """``keep(4)`` during a running ``forward`` was accepted: the tokens said P[:4] + the run while the
    cache held P[:n], and later logits were another context's (0.64 rel L2), silently."""
    assert QWEN3 is not None
    tokens = forward["tokens"].tolist()
    async with load(QWEN3) as model, model.sequence() as seq:
        await seq.forward(tokens[:8])
        refused: list[Exception] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(seq.forward, tokens[8:])
            with anyio.fail_after(30):
                while not seq._lock.locked():  # the forward has started
                    await anyio.lowlevel.checkpoint()
            try:
                seq.keep(4)
            except aioexperts.InvalidRequestError as exc:
                refused.append(exc)
        assert refused and "one at a time" in str(refused[0])
        assert seq.tokens == tokens and seq.n_past == len(tokens)
        seq.keep(4)  # once it has returned
        assert seq.n_past == 4
