"""Batched decode steps of the whole model (cross-request batching): every architecture's sequences get
bit for bit what they get alone; one sequence's failure or cancellation is its own."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
from conftest import shared_fixture_paths, whole_model_param
from test_batching import SMALL, THREADS, _alone, _assert_bit_equal, _decode

import aioexperts
from aioexperts._model.forward import ForwardPass
from aioexperts.testing._full_model import write_full_model

pytestmark = pytest.mark.anyio

#: one file of each architecture the whole model runs (F32 where there is one: their products
#: are the ones where a batched kernel sums in another order than the one-token kernel)
FIXTURES = [
    p
    for p in shared_fixture_paths()
    if p.with_name(p.stem + ".forward.npz").exists() and p.stem.endswith(("-f32", "-bf16", "q4_k_m"))
]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_full_model(tmp_path_factory.mktemp("decode-batch") / "small.gguf", SMALL)


@pytest.mark.parametrize("path", [whole_model_param(p) for p in FIXTURES])
async def test_every_architecture_decodes_batched_bit_equal_to_alone(path: Path, anyio_backend: object) -> None:
    tokens = np.load(path.with_name(path.stem + ".forward.npz"))["tokens"].tolist()
    prompts = [tokens[:6], tokens[::-1][:5], tokens[3:7]]
    alone = await _alone(path, prompts, 3, slots=64, io=THREADS)
    steps: list[int] = []
    plain = ForwardPass.run

    async def counted(self, batch):  # type: ignore[no-untyped-def]
        if len(batch) > 1:
            steps.append(len(batch))
        return await plain(self, batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ForwardPass, "run", counted)
        together = await _prefilled_then_together(path, prompts, 3)
    _assert_bit_equal(alone, together)
    assert steps == [len(prompts)] * 3  # every step ran the sequences together


async def _prefilled_then_together(path: Path, prompts: list[list[int]], steps: int) -> list[tuple[list[int], list]]:
    """Every prompt prefilled first, then the sequences decode greedily, each in its own task."""
    got: dict[int, tuple[list[int], list]] = {}
    async with aioexperts.load(path, batch_wait=1.0, slots=64, io=THREADS) as model:
        seqs = [model.sequence() for _ in prompts]
        first = [(await s.forward(p, all_logits=False))[0] for s, p in zip(seqs, prompts, strict=True)]

        async def one(i: int) -> None:
            logits, tokens, seen = first[i], [], [first[i]]
            for _ in range(steps):
                tokens.append(int(np.argmax(logits)))
                logits = (await seqs[i].forward(tokens[-1:], all_logits=False))[0]
                seen.append(logits)
            got[i] = (tokens, seen)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        for s in seqs:
            s.close()
    return [got[i] for i in range(len(prompts))]


async def test_a_sequence_whose_values_turn_non_finite_fails_alone(small_model: Path, anyio_backend: object) -> None:
    prompts = [[5, 17, 300], [9, 8, 7], [400, 12, 13]]
    alone = await _alone(small_model, prompts, 2, slots=64, io=THREADS)
    got: dict[int, object] = {}
    async with aioexperts.load(small_model, slots=64, io=THREADS, batch_wait=1.0) as model:
        seqs = [model.sequence() for _ in prompts]
        first = [(await s.forward(p, all_logits=False))[0] for s, p in zip(seqs, prompts, strict=True)]
        assert seqs[1]._cache is not None
        seqs[1]._cache.layer(1)["v"][0] = np.nan  # its layer-1 attention turns NaN from now on

        async def one(i: int) -> None:
            try:
                got[i] = (await seqs[i].forward([int(np.argmax(first[i]))], all_logits=False))[0]
            except aioexperts.NonFiniteError as exc:
                got[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
        assert model.statistics().batched_steps == 1
        assert model.forward_pass.steps.counters.retried_calls == 0  # failed in the step, not by running it again alone
        assert isinstance(got[1], aioexperts.NonFiniteError) and "block 1" in str(got[1])
        for i in (0, 2):
            assert isinstance(got[i], np.ndarray) and got[i].tobytes() == alone[i][1][1].tobytes()
        assert seqs[1].n_past == len(prompts[1])  # the failed step added nothing
        for s in seqs:
            s.close()


@pytest.mark.parametrize("victim", [0, 2])
async def test_a_sequence_cancelled_in_a_step_and_closed_leaves_the_others_results(
    small_model: Path, victim: int, anyio_backend: object
) -> None:
    prompts = [[5, 17, 300], [9, 8, 7], [400, 12, 13]]
    alone = await _alone(small_model, prompts, 2, slots=64, io=THREADS)
    entered, gate = anyio.Event(), anyio.Event()
    plain = ForwardPass.run

    async def held(self, batch):  # type: ignore[no-untyped-def]
        if len(batch) > 1:
            entered.set()
            await gate.wait()  # the step started: its sequences' caches are in the batch
        return await plain(self, batch)

    got: dict[int, np.ndarray] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ForwardPass, "run", held)
        async with aioexperts.load(small_model, slots=64, io=THREADS, batch_wait=1.0) as model:
            seqs = [model.sequence() for _ in prompts]
            first = [(await s.forward(p, all_logits=False))[0] for s, p in zip(seqs, prompts, strict=True)]
            scopes = [anyio.CancelScope() for _ in prompts]

            async def one(i: int) -> None:
                with scopes[i]:
                    got[i] = (await seqs[i].forward([int(np.argmax(first[i]))], all_logits=False))[0]

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    for i in range(3):
                        tg.start_soon(one, i)
                    await entered.wait()
                    scopes[victim].cancel()
                    await anyio.sleep(0.05)
                    seqs[victim].close()  # its KV cache freed while the step still writes into it
                    gate.set()
            assert sorted(got) == [i for i in range(3) if i != victim]
            for i, logits in got.items():
                assert logits.tobytes() == alone[i][1][1].tobytes()
            assert model.forward_pass.steps.counters.retried_calls == 0  # the step ran through for the others
            st = model.statistics()
            assert st.live_sequences == 2 and st.kv_bytes_in_use == 2 * model.n_ctx * st.kv_bytes_per_position
            for s in seqs:
                s.close()
            tokens, _ = await _decode(model, prompts[victim], 1)  # the model still serves
            assert tokens == alone[victim][0][:1]
