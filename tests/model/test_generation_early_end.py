"""A sequence's generation ended early (closed, left with ``break``, cancelled) keeps its last
yielded token for the next call, as the end of ``max_tokens`` does: continuing gives the tokens of
one uninterrupted run, never the same position sampled twice (a new-user trial found the token
repeated)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import aioexperts

pytestmark = pytest.mark.anyio

PROMPT = [5, 9, 11, 4, 7]
N = 14


def load(path: Path) -> aioexperts.Model:
    return aioexperts.load(path, slots=8, io=aioexperts.IOOptions(backend="threads"), n_ctx=64)


async def reference(model: aioexperts.Model) -> list[int]:
    return [t async for t in model.generate(PROMPT, max_tokens=N)]


async def test_closing_after_a_yield_keeps_the_token_for_the_next_call(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        ref = await reference(model)
        for stop_at in (1, 5, N - 1):
            async with model.sequence() as seq:
                got: list[int] = []
                async with seq.generate(PROMPT, max_tokens=N) as gen:
                    async for t in gen:
                        got.append(t)
                        if len(got) == stop_at:
                            break
                assert seq.unrun == [got[-1]] and seq.n_past == len(PROMPT) + stop_at - 1
                rest = [t async for t in seq.generate([], max_tokens=N - stop_at)]
                assert got + rest == ref, stop_at


async def test_a_loop_left_with_break_ends_at_the_sequences_next_call(tiny_full_model: Path) -> None:
    async with load(tiny_full_model) as model:
        ref = await reference(model)
        async with model.sequence() as seq:  # generate([]) continues
            got: list[int] = []
            async for t in seq.generate(PROMPT, max_tokens=N):
                got.append(t)
                if len(got) == 4:
                    break
            rest = [t async for t in seq.generate([], max_tokens=N - 4)]
            assert got + rest == ref
        async with model.sequence() as seq:  # forward() runs the kept token first
            got = []
            gen = seq.generate(PROMPT, max_tokens=N)
            async for t in gen:
                got.append(t)
                if len(got) == 3:
                    break
            logits = await seq.forward([])
            assert seq.tokens == PROMPT + got and int(logits[-1].argmax()) == ref[3]
            assert [t async for t in gen] == []  # the left generation has ended


@pytest.mark.parametrize("where", ["in-a-step", "in-the-loop-body"])
async def test_a_cancelled_generation_keeps_the_token_it_yielded(tiny_full_model: Path, where: str) -> None:
    async with load(tiny_full_model) as model:
        ref = await reference(model)
        async with model.sequence() as seq:
            got: list[int] = []

            async def run() -> None:
                async for t in seq.generate(PROMPT, max_tokens=N):
                    got.append(t)
                    if where == "in-the-loop-body" and len(got) == 6:
                        await anyio.sleep(3600)  # cancelled here, the generation suspended

            with anyio.move_on_after(30) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run)
                    while len(got) < 6:
                        await anyio.sleep(0.001)
                    tg.cancel_scope.cancel()  # in-a-step: most likely inside the next token's forward
            assert not scope.cancelled_caught
            assert 6 <= len(got) < N
            rest = [t async for t in seq.generate([], max_tokens=N - len(got))]
            assert got + rest == ref
            assert seq.tokens == PROMPT + ref[:-1]


async def test_a_prompt_that_never_ran_is_not_kept(tiny_full_model: Path) -> None:
    """Cancelled before its first token: nothing was yielded, nothing is kept (as before)."""
    async with load(tiny_full_model) as model:
        async with model.sequence() as seq:
            gen = seq.generate(PROMPT, max_tokens=N)
            await gen.aclose()
            assert seq.unrun == [] and seq.n_past == 0
