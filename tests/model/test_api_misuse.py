"""The model API's answers to misuse found by a new-user trial: each is one of the library's errors,
raised before any work, never a bare ``TypeError``/``AttributeError``/numpy error, a token from a
closed sequence, or a second consumer's error ending the first one's generation."""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

import aioexperts
from aioexperts._text.chat import ChatTemplate

pytestmark = pytest.mark.anyio

THREADS = aioexperts.IOOptions(backend="threads")


def load(path: Path, **kw: object) -> aioexperts.Model:
    return aioexperts.load(path, slots=8, io=THREADS, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", ["x", 1.5, -1, 2**64, True])
async def test_a_bad_seed_is_refused_on_both_paths_of_generate(tiny_full_model: Path, seed: object) -> None:
    async with load(tiny_full_model) as model:
        with pytest.raises(aioexperts.InvalidRequestError, match="seed"):
            model.generate([1, 2], max_tokens=2, temperature=0.7, seed=seed)  # type: ignore[arg-type]
        async with model.sequence() as seq:
            with pytest.raises(aioexperts.InvalidRequestError, match="seed"):
                seq.generate([1, 2], max_tokens=2, temperature=0.7, seed=seed)  # type: ignore[arg-type]
        with pytest.raises(aioexperts.ConfigError, match="seed"):  # the sampler chain's path
            model.generate([1, 2], max_tokens=2, temperature=0.7, top_k=5, seed=seed)  # type: ignore[arg-type]
        assert len([t async for t in model.generate([1, 2], max_tokens=2, temperature=0.7, seed=2**64 - 1)]) == 2


@pytest.mark.parametrize("full", [False, True])
async def test_generate_on_a_closed_sequence_yields_nothing_and_raises(tiny_full_model: Path, full: bool) -> None:
    async with load(tiny_full_model, n_ctx=4) as model:
        seq = model.sequence()
        await seq.forward([1, 2, 3, 4] if full else [1, 2, 3])
        seq.close()
        with pytest.raises(aioexperts.InvalidRequestError, match="closed"):
            seq.generate([], max_tokens=3)


async def test_text_calls_refuse_bad_types_with_the_librarys_errors(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        with pytest.raises(aioexperts.ConfigError, match="stop"):
            model.stream("Hi", stop=5)  # type: ignore[arg-type]
        with pytest.raises(aioexperts.ConfigError, match="stop"):
            model.generate("Hi", stop=5)  # type: ignore[arg-type]
        with pytest.raises(aioexperts.InvalidRequestError, match="sequence="):
            model.stream("Hi", sequence=5)  # type: ignore[arg-type]
        with pytest.raises(aioexperts.TokenizerError):
            model.tokenizer.decode(None)  # type: ignore[arg-type]
        with pytest.raises(aioexperts.TokenizerError):
            model.tokenizer.decode("12")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"template": "{{ messages }}"}, "ChatTemplate\\(source\\)"),
        ({"template": 5}, "template"),
        ({"options": {"top_k": 1}}, "options"),
    ],
)
async def test_chat_checks_its_template_and_options(tiny_full_model: Path, kw: dict[str, object], match: str) -> None:
    async with load(tiny_full_model) as model:
        with pytest.raises(aioexperts.ConfigError, match=match):
            model.chat(**kw)  # type: ignore[arg-type]
        async with model.chat(template=ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")) as chat:
            assert [p async for p in chat.send("Hi", max_tokens=2)]


async def test_a_second_consumer_of_one_generation_gets_a_clear_error_and_the_first_goes_on(
    tiny_full_model: Path,
) -> None:
    async with load(tiny_full_model) as model:
        want = [t async for t in model.generate([5, 6, 7], max_tokens=4)]
        for stream in (False, True):
            extra = {"top_k": 1} if stream else {}  # top_k: the sampler chain's stream
            gen = model.generate([5, 6, 7], max_tokens=4, **extra)
            got: list[int] = []
            errors: list[BaseException] = []

            async def first(gen: aioexperts.Generation = gen, got: list[int] = got) -> None:
                got.extend([t async for t in gen])

            async def second(gen: aioexperts.Generation = gen, errors: list[BaseException] = errors) -> None:
                await anyio.lowlevel.checkpoint()
                try:
                    await gen.__anext__()
                except aioexperts.InvalidRequestError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                tg.start_soon(second)
            assert got == want
            assert len(errors) == 1 and "another task" in str(errors[0])


async def test_a_budget_below_one_position_and_a_negative_embedding_limit_are_refused(tiny_full_model: Path) -> None:
    with pytest.raises(aioexperts.ConfigError, match="resident_embedding_bytes"):
        load(tiny_full_model, resident_embedding_bytes=-1)
    model = load(tiny_full_model, memory_budget=1)
    with pytest.raises(aioexperts.ConfigError, match="memory_budget"):
        async with model:
            pass


async def test_a_stream_on_a_busy_sequence_says_busy(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model, model.sequence() as seq:
        async with anyio.create_task_group() as tg:
            tg.start_soon(seq.forward, list(range(1, 40)))
            with anyio.fail_after(5):
                while not seq.busy:
                    await anyio.lowlevel.checkpoint()
            with pytest.raises(aioexperts.InvalidRequestError, match="running") as caught:
                model.stream("Hi", sequence=seq)
            assert "keep()" not in str(caught.value)  # the user called no keep()
        assert not seq.busy
