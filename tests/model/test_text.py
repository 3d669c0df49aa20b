"""Text in, text out: prompts as text or ids, streaming, stop strings, chat sessions, bad input.

The model is the built-in full model at a test size (``tiny_full_model`` in tests/conftest.py: a
byte-level BPE vocabulary, a ChatML template, random weights); scripted samplers make the model
"say" chosen bytes so the decoder and the stop matcher see characters split across tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import numpy as np
import pytest
from conftest import shared_fixture_paths

import aioexperts
from aioexperts._model.text import chat_prompt_ids

pytestmark = pytest.mark.anyio

THREADS = aioexperts.IOOptions(backend="threads")
MULTIBYTE = "Grüße, 日本語 ✓ naïve €5 🙂!"


def load(path: Path, **kw: object) -> aioexperts.Model:
    return aioexperts.load(path, slots=8, io=THREADS, **kw)  # type: ignore[arg-type]


def byte_ids(tok: aioexperts.Tokenizer, text: str) -> list[int]:
    """One byte token per UTF-8 byte of ``text`` (so every multi-byte character spans tokens)."""
    ids = []
    for b in text.encode():
        found = [t for t in range(tok.n_vocab) if tok.piece(t) == bytes([b])]
        assert found, f"no byte token for 0x{b:02x}"
        ids.append(found[0])
    return ids


class Script:
    """A sampler that returns ``ids`` in order, then the EOS id."""

    def __init__(self, ids: Sequence[int], eos: int) -> None:
        self.ids = list(ids)
        self.eos = eos
        self.histories: list[int] = []

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        assert logits.shape == (logits.shape[0],) and logits.dtype == np.float32
        self.histories.append(len(history))
        return self.ids.pop(0) if self.ids else self.eos


async def test_stream_pieces_join_to_decode_and_never_split_a_character(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        tok = model.tokenizer
        assert tok.eos_id is not None
        ids = byte_ids(tok, MULTIBYTE)
        stream = model.stream("Hi", sampler=Script(ids, tok.eos_id), max_tokens=200)
        pieces = [p async for p in stream]
    assert stream.token_ids == ids
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE
    assert len(pieces) > 10 and all(pieces) and not any("\ufffd" in p for p in pieces)
    assert stream.statistics.stop_reason == "eog" and stream.statistics.generated_tokens == len(ids)


async def test_sampled_stream_joins_to_decode_of_its_ids(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        stream = model.stream(MULTIBYTE, max_tokens=48, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
        pieces = [p async for p in stream]
        assert "".join(pieces) == model.tokenizer.decode(stream.token_ids)
    s = stream.statistics
    assert s.generated_tokens == len(stream.token_ids) > 0
    assert s.prompt_tokens == len(model.tokenizer.encode(MULTIBYTE)) == s.prefilled_tokens
    assert s.time_to_first_token is not None and s.time_to_first_token > 0


async def test_stop_string_split_across_tokens_is_not_emitted(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        tok = model.tokenizer
        assert tok.eos_id is not None
        ids = byte_ids(tok, "ab✓ STOP and more")
        stream = model.stream("Hi", sampler=Script(ids, tok.eos_id), max_tokens=100, stop=["STOP", "zzz"])
        pieces = [p async for p in stream]
    assert "".join(pieces) == "ab✓ "
    assert not any("S" in p for p in pieces)
    s = stream.statistics
    assert s.stop_reason == "stop" and s.stop_string == "STOP"
    assert s.generated_tokens == len(byte_ids(tok, "ab✓ STOP"))  # nothing after the stop string was generated


async def test_text_and_id_prompts_generate_the_same_greedy_ids(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        from_text = [t async for t in model.generate("Once upon a time", max_tokens=12)]
        ids = model.tokenizer.encode("Once upon a time")
        from_ids = [t async for t in model.generate(ids, max_tokens=12)]
        logits = await model.logits(ids)
        stream = model.stream(np.array(ids), max_tokens=12)
        text = "".join([p async for p in stream])
    assert from_text == from_ids and len(from_ids) == 12
    assert from_ids[0] == int(np.argmax(logits[-1]))  # greedy by default
    assert stream.token_ids == from_ids and text == model.tokenizer.decode(from_ids)


async def test_generation_stops_at_the_end_of_generation_id_without_yielding_it(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        im_end = model.tokenizer.token_to_id("<|im_end|>")
        assert im_end is not None and im_end in model.tokenizer.eog_ids
        script = Script([5, 6, 7], im_end)
        gen = model.generate("Hello", sampler=script, max_tokens=50)
        got = [t async for t in gen]
        n_prompt = len(model.tokenizer.encode("Hello"))
    assert got == [5, 6, 7]
    assert gen.statistics.stop_reason == "eog" and gen.statistics.generated_tokens == 3
    assert script.histories == [n_prompt, n_prompt + 1, n_prompt + 2, n_prompt + 3]


async def test_a_full_kv_cache_ends_generation_without_truncating(tiny_full_model: Path) -> None:
    async with load(tiny_full_model, n_ctx=16) as model:
        ids = model.tokenizer.encode("one two three")
        stream = model.stream(ids, max_tokens=100, temperature=1.0, seed=1)
        [p async for p in stream]
    assert stream.statistics.stop_reason == "length"
    # prompt plus generated tokens take every position, as the server's max_tokens = n_ctx - prompt
    assert len(ids) + len(stream.token_ids) == 16


def _never_eog(logits: np.ndarray, history: Sequence[int]) -> int:
    return 65  # a byte token, never an end-of-generation id


async def test_every_path_stops_at_n_ctx_with_length_and_no_error(tiny_full_model: Path) -> None:
    """16 prompt tokens and n_ctx=24: 8 tokens on every path, stop reason "length", no ContextLengthError
    (issue 31: the ids path yielded 9, then raised)."""
    async with load(tiny_full_model, n_ctx=24) as model:
        assert 65 not in model.tokenizer.eog_ids
        prompt = list(range(100, 116))
        gen = model.generate(prompt, max_tokens=100, sampler=_never_eog)  # the ids path: a Generation
        assert isinstance(gen, aioexperts.Generation)
        assert [t async for t in gen] == [65] * 8 and gen.stop_reason == "length"
        tokens = model.generate(prompt, max_tokens=100, sampler=_never_eog, top_k=1)  # the sampler chain
        assert [t async for t in tokens] == [65] * 8 and tokens.statistics.stop_reason == "length"
        assert tokens.statistics.generated_tokens == 8
        stream = model.stream(prompt, max_tokens=100, sampler=_never_eog)
        assert "".join([p async for p in stream]) == model.tokenizer.decode([65] * 8)
        assert stream.statistics.stop_reason == "length" and len(stream.token_ids) == 8
        # max_tokens that fit exactly: the same stop, the same tokens
        exact = model.generate(prompt, max_tokens=8, sampler=_never_eog)
        assert len([t async for t in exact]) == 8 and exact.stop_reason == "length"
        # a prompt that fills the cache: nothing to generate, and nothing was run for it
        before = model.statistics().tokens_prefilled
        full = model.generate(list(range(100, 124)), max_tokens=5, sampler=_never_eog)
        assert [t async for t in full] == [] and full.stop_reason == "length"
        filled = model.stream(list(range(100, 124)), max_tokens=5, sampler=_never_eog)
        assert [p async for p in filled] == [] and filled.statistics.stop_reason == "length"
        assert model.statistics().tokens_prefilled == before
        async with model.chat() as chat:
            n_prompt = len(model.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True))
            reply = chat.send("Hi", sampler=_never_eog, max_tokens=100)
            text = "".join([p async for p in reply])
            assert text == model.tokenizer.decode([65] * (24 - n_prompt))
            assert reply.statistics.stop_reason == "length"
        async with model.sequence() as seq:  # a sequence's generate: the yielded tokens still fit
            got = [t async for t in seq.generate(prompt, max_tokens=100, sampler=_never_eog)]
            assert len(got) == 8 and seq.n_past + len(seq.unrun) == 24
            await seq.forward([])  # the last yielded token runs into the last position
            assert seq.n_past == 24 and seq.unrun == []
            more = seq.generate([], max_tokens=3, sampler=_never_eog)
            assert [t async for t in more] == [] and more.stop_reason == "length"
        async with model.sequence() as seq:  # a prompt that fills the cache is kept for the next call
            fill = seq.generate(list(range(100, 124)), max_tokens=3, sampler=_never_eog)
            assert [t async for t in fill] == [] and fill.stop_reason == "length"
            assert seq.n_past + len(seq.unrun) == 24
            with pytest.raises(aioexperts.ContextLengthError):
                await seq.forward([1])
        eog = model.generate(prompt, max_tokens=100, sampler=lambda logits, h: sorted(model.hparams.eog_ids)[0])
        assert [t async for t in eog] == [] and eog.stop_reason == "eog"
        assert model.statistics().live_sequences == 0


@pytest.mark.parametrize("prompt", ["", []])
async def test_an_empty_prompt_is_refused(tiny_full_model: Path, prompt: str | list[int]) -> None:
    async with load(tiny_full_model) as model:
        with pytest.raises(aioexperts.InvalidRequestError, match="empty"):
            model.stream(prompt, max_tokens=4)
        with pytest.raises(aioexperts.InvalidRequestError, match="empty"):
            model.generate(prompt, max_tokens=4)
        assert model.statistics().live_sequences == 0


async def test_a_tokenizer_and_template_built_before_the_start_are_kept(tiny_full_model: Path) -> None:
    """``aioexperts-run`` tokenizes the prompt before the load: the start does not build them again."""
    model = load(tiny_full_model)
    user = [{"role": "user", "content": "Hi"}]

    def before_the_start() -> tuple[object, object, object]:  # the file's metadata, read in a worker
        return model.tokenizer, model.chat_template, model.apply_chat_template(user, tokenize=True)

    tokenizer, template, ids = await anyio.to_thread.run_sync(before_the_start)
    async with model:
        assert model.tokenizer is tokenizer and model.chat_template is template
        assert model.apply_chat_template(user, tokenize=True) == ids


async def test_a_prompt_longer_than_n_ctx_is_refused_not_truncated(tiny_full_model: Path) -> None:
    async with load(tiny_full_model, n_ctx=32) as model:
        text = "the quick brown fox jumps over the lazy dog " * 10
        n = len(model.tokenizer.encode(text))
        assert n > 32
        with pytest.raises(aioexperts.ContextLengthError, match=rf"{n} tokens, more than n_ctx=32"):
            model.stream(text, max_tokens=4)
        with pytest.raises(aioexperts.ContextLengthError):
            model.generate(model.tokenizer.encode(text), max_tokens=4)
        async with model.chat() as chat:
            with pytest.raises(aioexperts.ContextLengthError):
                chat.send(text)
            assert chat.messages == []
        stats = model.statistics()
    assert stats.tokens_prefilled == 0 and stats.tokens_decoded == 0  # nothing ran
    assert issubclass(aioexperts.ContextLengthError, aioexperts.AioExpertsError)


async def test_ids_outside_the_vocabulary_are_refused(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        for bad in ([1, model.n_vocab], [-1], [1.5]):
            with pytest.raises(aioexperts.InvalidRequestError):
                model.generate(bad, max_tokens=2)  # type: ignore[arg-type]
        with pytest.raises(aioexperts.InvalidRequestError, match="not a token id"):
            [t async for t in model.generate([1, 2], max_tokens=2, sampler=lambda logits, h: model.n_vocab)]
        with pytest.raises(aioexperts.InvalidRequestError, match="bytes"):
            model.stream(b"hello", max_tokens=2)  # type: ignore[arg-type]
        # not a str nor a sequence: was list(123)'s bare TypeError
        for bad_prompt, name in ((123, "int 123"), (None, "NoneType None"), (1.5, "float 1.5")):
            with pytest.raises(aioexperts.InvalidRequestError) as refused:
                model.stream(bad_prompt, max_tokens=2)  # type: ignore[arg-type]
            assert str(refused.value) == f"the prompt must be a str or a sequence of token ids (ints), got {name}"
            with pytest.raises(aioexperts.InvalidRequestError):  # the ids path says it in its words
                model.generate(bad_prompt, max_tokens=2)  # type: ignore[arg-type]


async def test_special_token_texts_are_plain_text_unless_parsed(tiny_full_model: Path) -> None:
    """``<|im_end|>`` is its control token only with parse_special; an unknown ``<|...|>`` is always text."""
    async with load(tiny_full_model) as model:
        tok = model.tokenizer
        im_end = tok.token_to_id("<|im_end|>")
        assert im_end in tok.encode("a<|im_end|>b", parse_special=True)
        assert im_end not in tok.encode("a<|im_end|>b")
        for parse in (False, True):
            ids = tok.encode("<|no_such_token|>", parse_special=parse)
            assert len(ids) > 1 and tok.decode(ids) == "<|no_such_token|>"
        gen = model.generate("x<|im_end|>", parse_special=True, max_tokens=1)
        [t async for t in gen]
        assert gen.statistics.prompt_tokens == len(tok.encode("x")) + 1


async def test_bad_sampling_options_are_config_errors(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        with pytest.raises(aioexperts.ConfigError, match="top_p"):
            model.stream("hi", top_p=2.0)
        with pytest.raises(aioexperts.ConfigError, match="not both"):
            model.stream("hi", options=aioexperts.SamplingOptions(), temperature=0.5)
        with pytest.raises(aioexperts.ConfigError):
            model.stream("hi", stop=[""])
        async with model.chat() as chat:
            with pytest.raises(aioexperts.ConfigError, match="no_such_field"):
                chat.send("hi", no_such_field=1)


@pytest.mark.parametrize("first_reply", ["greedy", "byte tokens"])
async def test_chat_reuses_the_cached_prefix_and_matches_a_fresh_prefill(
    tiny_full_model: Path, first_reply: str
) -> None:
    """With byte tokens the first reply re-tokenizes differently, so the cache is cut back (keep).

    A float32 KV cache: with the default F16 one, the partial prefill's float32 noise (other batch
    sizes) flips F16 roundings, and this random-weight model's near-ties follow (as in llama.cpp)."""
    async with load(tiny_full_model, kv_type="f32") as model:
        greedy6 = aioexperts.SamplingOptions(temperature=0, max_tokens=6)
        async with model.chat("You are terse.", options=greedy6) as chat:
            tok = model.tokenizer
            assert tok.eos_id is not None
            sampler = Script(byte_ids(tok, "Hello world"), tok.eos_id) if first_reply == "byte tokens" else None
            first = "".join([p async for p in chat.send("Hello there", sampler=sampler, max_tokens=20)])
            s1 = chat.statistics()
            held = list(chat._seq.tokens)  # type: ignore[union-attr]
            stream = chat.send("And again?")
            second = "".join([p async for p in stream])
            s2 = chat.statistics()
            messages = list(chat.messages)
        assert s1.reused_tokens == 0 and s1.prefilled_tokens == s1.prompt_tokens
        prompt2 = model.apply_chat_template(messages[:-1], tokenize=True)
        assert isinstance(prompt2, list) and s2.prompt_tokens == len(prompt2)
        common = next(i for i, (a, b) in enumerate(zip([*held, -1], prompt2, strict=False)) if a != b)
        assert s2.reused_tokens == common > s1.prompt_tokens // 2
        if first_reply == "byte tokens":
            assert first == "Hello world" and common < len(held)  # the cache held tokens the new prompt lacks
        assert s2.prefilled_tokens == s2.prompt_tokens - s2.reused_tokens
        # the reply after the partial prefill is the reply to the whole prompt on a fresh sequence
        fresh = [t async for t in model.generate(prompt2, max_tokens=6)]
        assert stream.token_ids == fresh
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == first and messages[4]["content"] == second


async def test_a_chat_turn_closed_early_leaves_the_conversation_as_it_was(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        async with model.chat() as chat:
            async with chat.send("Hello", max_tokens=30, temperature=1.0, seed=3) as stream:
                async for _ in stream:
                    break
            assert chat.messages == [] and stream.statistics.stop_reason == "cancelled"
            with pytest.raises(aioexperts.InvalidRequestError, match="non-empty"):
                chat.send("")
            reply = "".join([p async for p in chat.send("Hello", max_tokens=3)])
            assert chat.messages == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": reply}]
            assert chat.statistics().reused_tokens > 0  # the abandoned turn's prompt is still cached
        with pytest.raises(aioexperts.InvalidRequestError, match="closed"):
            chat.send("more")


async def test_two_turns_at_once_are_refused(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model, model.chat() as chat:
        first = chat.send("one", max_tokens=4)
        second = chat.send("two", max_tokens=4)
        assert await first.__anext__()  # the first turn runs
        with pytest.raises(aioexperts.InvalidRequestError, match="still running"):
            await second.__anext__()
        await first.aclose()


async def test_broken_templates_are_chat_template_errors(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        with pytest.raises(aioexperts.ChatTemplateError):
            aioexperts.ChatTemplate("{% for m in messages %}{{ m.content }")
        refusing = aioexperts.ChatTemplate(
            "{% for m in messages %}{% if m.role == 'user' %}{{ raise_exception('no users here') }}"
            "{% endif %}{% endfor %}"
        )
        async with model.chat(template=refusing) as chat:
            with pytest.raises(aioexperts.ChatTemplateError, match="no users here"):
                chat.send("hi")
            assert chat.messages == []
        with pytest.raises(aioexperts.ChatTemplateError):
            model.apply_chat_template([{"role": "user", "content": "x"}], tools=[42])  # type: ignore[list-item]
        empty = aioexperts.ChatTemplate("{% if false %}x{% endif %}")
        async with model.chat(template=empty) as chat:
            with pytest.raises(aioexperts.InvalidRequestError, match="empty prompt"):
                chat.send("hi")
        # tokenizing an empty rendering is what encode("") gives, as transformers' apply_chat_template
        model._chat_template = empty
        assert model.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True) == model.tokenizer.encode(
            "", add_special=True
        )
        assert model.apply_chat_template([{"role": "user", "content": "x"}]) == ""


def test_chat_prompt_ids_do_not_double_the_bos_of_the_template() -> None:
    """llama.cpp's common_chat removes a template-written BOS when the vocabulary adds one."""
    vocab = Path("/work/shared/vocab/ggml-vocab-phi-3.gguf")
    candidates = [p for p in shared_fixture_paths() if p.name == vocab.name] or ([vocab] if vocab.exists() else [])
    if not candidates:
        pytest.skip("the shared phi-3 vocabulary is not here")
    tok = aioexperts.Tokenizer.from_gguf(candidates[0])
    assert tok.add_bos and tok.bos_id is not None
    bos = tok.token_text(tok.bos_id)
    template = aioexperts.ChatTemplate(
        "{{ bos_token }}{% for m in messages %}<|user|>{{ m.content }}<|end|>{% endfor %}", bos_token=bos
    )
    text = template.render([{"role": "user", "content": "hello"}])
    assert text.startswith(bos)
    ids = chat_prompt_ids(tok, template, text)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id
    assert ids == tok.encode(text[len(bos) :], add_special=True, parse_special=True)
    assert tok.token_to_id("<|user|>") in ids  # special tokens are parsed


async def test_a_file_without_a_vocabulary_runs_on_ids_and_refuses_text() -> None:
    paths = [p for p in shared_fixture_paths() if p.name == "qwen3moe-f32.gguf"]
    if not paths:
        pytest.skip("shared fixtures not found")
    async with load(paths[0]) as model:
        ids = [t async for t in model.generate([1, 2, 3], max_tokens=3)]
        assert len(ids) == 3
        with pytest.raises(aioexperts.VocabularyError, match="no tokenizer"):
            model.stream("hello", max_tokens=2)
        with pytest.raises(aioexperts.ChatTemplateError, match="chat_template"):
            model.chat()


async def test_ids_need_no_text_extra_and_text_names_it(
    tiny_full_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "copy.gguf"  # a path the tokenizer cache has not seen
    copy.write_bytes(tiny_full_model.read_bytes())
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now fails
    async with load(copy) as model:
        assert len([t async for t in model.generate([1, 2], max_tokens=2)]) == 2
        with pytest.raises(aioexperts.AioExpertsError, match=r"pip install 'aioexperts\[text\]'"):
            model.stream("hello", max_tokens=2)


async def test_streams_hold_a_kv_cache_only_while_they_run(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        model.stream("never iterated", max_tokens=4)
        model.generate("never iterated", max_tokens=4, top_k=5)
        assert model.statistics().live_sequences == 0
        async with model.stream("Hello", max_tokens=20, temperature=1.0, seed=2) as stream:
            await stream.__anext__()
            assert model.statistics().live_sequences == 1
        assert model.statistics().live_sequences == 0 and stream.statistics.stop_reason == "cancelled"
        gen = model.generate("Hello", max_tokens=3, top_k=5)
        assert len([t async for t in gen]) == 3
        assert model.statistics().live_sequences == 0 and gen.statistics.stop_reason == "length"


async def test_a_prefill_that_stops_midway_counts_only_the_batches_that_ran(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    """Ctrl-C during a long prompt reported every prompt token as prefilled (fresh-user trial)."""
    from aioexperts._model import sessions
    from aioexperts._model.sessions import ModelSequence

    monkeypatch.setattr(sessions, "PREFILL_BATCH", 4)
    forward = ModelSequence.forward
    calls = [0]

    async def second_batch_fails(self: ModelSequence, ids: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("stopped in the prefill")
        return await forward(self, ids, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ModelSequence, "forward", second_batch_fails)
    async with load(tiny_full_model, n_ctx=64) as model:
        run = model.generate(list(range(1, 13)), max_tokens=2, top_k=1)  # the sampler chain: a TokenStream
        with pytest.raises(RuntimeError, match="stopped in the prefill"):
            async for _ in run:
                pass
        s = run.statistics
    assert (s.prompt_tokens, s.prefilled_tokens, s.stop_reason) == (12, 4, "error")
