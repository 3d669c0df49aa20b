"""The prompt cache's pool on its own (aioexperts/serve/_prompt_cache.py) and the hook it stands on:
``Model.stream(..., sequence=)`` keeps the longest prefix and prefills the rest, and a sequence
that cannot rewind (recurrent state, ``ModelSequence.rewinds`` False) is only continued from
all it holds."""

from __future__ import annotations

from pathlib import Path

import pytest

import aioexperts
from aioexperts.serve._prompt_cache import PromptCache, default_capacity_bytes

pytestmark = pytest.mark.anyio

THREADS = aioexperts.IOOptions(backend="threads")


def _load(path: Path) -> aioexperts.Model:
    return aioexperts.load(path, slots=8, io=THREADS)


async def _filled(model: aioexperts.Model, ids: list[int]) -> aioexperts.ModelSequence:
    seq = model.sequence()
    await seq.forward(ids, all_logits=False)
    return seq


async def _greedy(model: aioexperts.Model, ids: list[int], seq: aioexperts.ModelSequence | None) -> tuple[str, int]:
    async with model.stream(ids, max_tokens=6, temperature=0, sequence=seq) as stream:
        text = "".join([piece async for piece in stream])
    return text, stream.statistics.reused_tokens


async def test_stream_on_a_sequence_keeps_the_common_prefix_and_answers_as_a_fresh_one(tiny_full_model: Path) -> None:
    async with _load(tiny_full_model) as model:
        base = list(range(10, 40))
        seq = await _filled(model, [*base, 5, 6, 7])
        prompt = [*base, 8, 9]
        text, reused = await _greedy(model, prompt, seq)
        assert reused == len(base) and not seq.closed  # the sequence is the caller's: still open
        assert seq.tokens[: len(prompt)] == prompt
        fresh_text, fresh_reused = await _greedy(model, prompt, None)
        assert (text, fresh_reused) == (fresh_text, 0)
        same_text, reused = await _greedy(model, prompt, await _filled(model, prompt))
        assert reused == len(prompt) - 1 and same_text == fresh_text  # the last token runs again for its logits


async def test_a_sequence_that_cannot_rewind_is_continued_only_from_all_it_holds(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aioexperts.ModelSequence, "rewinds", property(lambda self: False))
    async with _load(tiny_full_model) as model:
        seq = await _filled(model, [10, 11, 12, 13])
        with pytest.raises(aioexperts.InvalidRequestError, match="cannot rewind"):
            model.stream([10, 11, 99], max_tokens=2, sequence=seq)
        assert seq.n_past == 4  # refused before anything was dropped
        cache = PromptCache(model, 1 << 40)
        cache.put(seq)
        fresh, kept = cache.take([10, 11, 99])  # diverges inside the cached tokens: not usable
        assert kept == 0 and fresh is not seq and cache.entries == 1
        fresh.close()
        same, kept = cache.take([10, 11, 12, 13])  # exactly what it holds: the last would need a rewind
        assert kept == 0 and same is not seq
        same.close()
        longer, kept = cache.take([10, 11, 12, 13, 14, 15])
        assert longer is seq and kept == 4 and cache.entries == 0
        seq.close()


async def test_the_pool_takes_the_longest_prefix_and_evicts_the_least_recently_used(tiny_full_model: Path) -> None:
    async with _load(tiny_full_model) as model:
        probe = PromptCache(model, 0)
        per = probe.sequence_bytes
        assert per == model.n_ctx * model.statistics().kv_bytes_per_position > 0
        cache = PromptCache(model, 2 * per)
        a = await _filled(model, [1, 2, 3, 4, 5, 6])
        b = await _filled(model, [1, 2, 3, 7, 8, 9])
        cache.put(a)
        cache.put(b)
        seq, kept = cache.take([1, 2, 3, 4, 5, 6, 10])
        assert seq is a and kept == 6 and cache.entries == 1  # out of the pool while in use
        cache.put(a)
        c = await _filled(model, [20, 21, 22])
        cache.put(c)  # three in a budget of two: b, the least recently used, is closed
        assert cache.entries == 2 and cache.evictions == 1 and b.closed and not a.closed
        assert model.statistics().live_sequences == 2
        longer = await _filled(model, [1, 2, 3, 4, 5, 6, 10, 11])
        cache.put(longer)  # a's tokens all start it: a is closed, not kept twice
        assert a.closed and cache.entries == 2
        cache.clear()
        assert c.closed and longer.closed and model.statistics().live_sequences == 0
        nothing = PromptCache(model, per - 1)  # not even one sequence: nothing is pooled
        d = await _filled(model, [1, 2])
        nothing.put(d)
        assert d.closed and nothing.entries == 0


def test_the_default_budget_is_half_of_what_is_left_after_the_running_sequences() -> None:
    assert default_capacity_bytes(10_000, 1_000, 4) == 3_000
    assert default_capacity_bytes(3_000, 1_000, 4) == 0
