"""The held pass: a model whose every routed expert is resident decodes in one compute job, with
the numbers of the layer-by-layer pass."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_fixture_paths

import aioexperts
from aioexperts import _executor
from aioexperts._compute.pool import compute_pool
from aioexperts._runner import MoERunner

pytestmark = pytest.mark.anyio

FIXTURES = {p.stem: p for p in shared_fixture_paths()}
needs = pytest.mark.skipif("qwen3moe-f32" not in FIXTURES, reason="shared fixtures not found")


async def load_every_expert(model: aioexperts.Model) -> None:
    store = model.store
    for layer, moe in store.layout.layers.items():
        async with store.experts(layer, range(moe.n_experts)):
            pass


async def decode(model: aioexperts.Model, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Logits of the prompt's last row and of ``steps`` greedy tokens, and each step's compute-pool jobs."""
    pool = compute_pool()
    out, jobs = [], []
    async with model.sequence() as seq:
        logits = (await seq.forward(prompt))[-1]
        out.append(logits)
        for _ in range(steps):
            n = pool.statistics().jobs
            logits = (await seq.forward([int(logits.argmax())]))[-1]
            jobs.append(pool.statistics().jobs - n)
            out.append(logits)
    return out, jobs


@needs
@pytest.mark.parametrize(
    "name", ["qwen3moe-f32", "deepseek2-q4_k_m", "deepseek4-f32", "qwen35moe-f32", "glm4moe-f32", "gpt-oss-f32"]
)
async def test_held_pass_equals_the_layer_by_layer_pass(
    name: str, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = FIXTURES.get(name)
    if path is None:
        pytest.skip(f"{name} not among the fixtures")
    prompt = [11, 22, 33, 44, 55]
    got: dict[str, tuple[list[np.ndarray], list[int]]] = {}
    from_table = []
    row_ffn_out_at = _executor.row_ffn_out_at

    def counted(*args: object) -> object:
        out = row_ffn_out_at(*args)  # type: ignore[arg-type]
        from_table.append(out is not None)
        return out

    monkeypatch.setattr(_executor, "row_ffn_out_at", counted)
    async with aioexperts.load(path, slots=4096, batch_wait=0) as model:
        await load_every_expert(model)
        n_layer = model.hparams.n_layer
        n_moe = len(model.store.layout.layers)
        got["held"] = await decode(model, prompt, 4)
        runner_stats = model.runner.statistics()
        with monkeypatch.context() as m:
            m.setattr(MoERunner, "hold_resident", lambda self: contextlib.nullcontext(None))
            got["layers"] = await decode(model, prompt, 4)
    for a, b in zip(got["held"][0], got["layers"][0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got["held"][1] == [2] * 4  # the embedding rows and the whole pass
    assert all(n >= 2 + n_layer - 1 for n in got["layers"][1])  # about one per block
    assert runner_stats.layer_steps > 0 and runner_stats.compute_seconds > 0
    if name == "deepseek2-q4_k_m":  # int8 experts: a prepared step per layer, found in the layer's table
        assert sum(from_table) >= 3 * n_moe  # each layer's first call makes the step


@needs
@pytest.mark.parametrize("name", ["qwen3moe-f32", "deepseek4-f32", "glm4moe-f32"])
async def test_a_held_pass_goes_on_through_the_executor_at_a_missing_expert(
    name: str, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a cold slab with room for the model: the held pass stops at the first layer with an
    expert to read and the executor goes on from there; the numbers are the layer-by-layer pass's,
    and once every expert it routes to is resident a step is one job."""
    path = FIXTURES.get(name)
    if path is None:
        pytest.skip(f"{name} not among the fixtures")
    prompt = [11, 22, 33]
    got = {}
    for mode in ("held", "layers"):
        with monkeypatch.context() as m:
            if mode == "layers":
                m.setattr(MoERunner, "hold_resident", lambda self: contextlib.nullcontext(None))
            async with aioexperts.load(path, slots=4096, batch_wait=0) as model:
                got[mode] = await decode(model, prompt, 6)
                if mode == "held":
                    assert any(n > 2 for n in got[mode][1])  # some steps read experts
                    await load_every_expert(model)
                    _, jobs = await decode(model, prompt, 2)
                    assert jobs == [2, 2]
    for a, b in zip(got["held"][0], got["layers"][0], strict=True):
        np.testing.assert_array_equal(a, b)


@needs
async def test_no_held_pass_with_a_slab_smaller_than_the_model(anyio_backend: object) -> None:
    """A slab that may have to evict never holds (a hold would stall its reads)."""
    path = FIXTURES["qwen3moe-f32"]
    async with aioexperts.load(path, slots=4096, batch_wait=0) as model:
        n_total = model.store.layout.n_experts_total
    async with aioexperts.load(path, slots=n_total - 1, batch_wait=0) as model:
        await decode(model, [11, 22, 33], 4)
        _, jobs = await decode(model, [11, 22, 33], 2)
        assert all(n > 2 for n in jobs)


@needs
async def test_a_long_prompt_goes_layer_by_layer(anyio_backend: object) -> None:
    """Up to HELD_MAX_ROWS rows in one job (the embedding's job before it, the decode preparation's
    after it: 3); a longer prompt keeps a hand-off per layer (a cancellation waits for one layer,
    not the whole prompt)."""
    from aioexperts._model.forward import HELD_MAX_ROWS

    pool = compute_pool()
    async with aioexperts.load(FIXTURES["qwen3moe-f32"], slots=4096, batch_wait=0) as model:
        await load_every_expert(model)
        for n_rows, held in ((HELD_MAX_ROWS, True), (HELD_MAX_ROWS + 1, False)):
            async with model.sequence() as seq:
                n = pool.statistics().jobs
                await seq.forward([1 + i % 50 for i in range(n_rows)])
                jobs = pool.statistics().jobs - n
            assert (jobs == 3) is held, (n_rows, jobs)


@pytest.mark.parametrize("found_by", ["views", "table"])
def test_a_prepared_steps_non_finite_output_is_refused_as_the_general_paths(
    found_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ResidentPass.moe checks the prepared step's output as _combine_calls checks the general path's,
    whether the experts were found as views or in the layer's table."""
    from types import SimpleNamespace

    from aioexperts import _executor

    class Experts:
        requests = 0

        def views(self, layer: int, ids: list[int]) -> list[object]:
            return [object() for _ in ids]

        def table(self, layer: int) -> object:
            return object() if found_by == "table" else None

    def overflowed(plan: object, views: object, steps: object) -> np.ndarray:
        return np.array([[1.0, np.inf, 0.0, 0.0]], dtype=np.float32)

    def unused(plan: object, views: object, steps: object) -> np.ndarray:
        raise AssertionError("the table served")

    monkeypatch.setattr(_executor, "row_ffn_out", overflowed if found_by == "views" else unused)
    monkeypatch.setattr(_executor, "row_ffn_out_at", overflowed)
    plan = SimpleNamespace(x=np.ones((1, 4), dtype=np.float32))
    routing = SimpleNamespace(plan=plan, groups=[SimpleNamespace(experts=[1, 2])])
    experts = Experts()
    held = _executor.ResidentPass(experts)  # type: ignore[arg-type]
    with pytest.raises(aioexperts.InvalidRequestError, match="overflowed float32"):
        held.moe(3, routing)  # type: ignore[arg-type]
    assert held.steps == 1 and held.experts == 2  # counted before the error, as a failed general step
    assert experts.requests == (2 if found_by == "table" else 0)  # views() counts its own


_CLOSE_DURING_PASS = r"""
import asyncio, json, sys, time
import numpy as np
import aioexperts
from aioexperts import _executor
from aioexperts._compute.pool import compute_pool
from aioexperts.testing import SyntheticSpec, write_synthetic_model

path = sys.argv[1]
write_synthetic_model(path, SyntheticSpec(n_layer=4, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2))
computed = _executor.row_ffn_out_at

def slow(*args):
    time.sleep(0.3)  # the compute thread is descheduled between finding the experts and computing them
    return computed(*args)

async def main():
    store = aioexperts.open(path, slots=32)
    await store.__aenter__()
    runner = aioexperts.MoERunner(store, batch_wait=0)
    await runner.warmup()
    for layer, moe in store.layout.layers.items():
        async with store.experts(layer, range(moe.n_experts)):
            pass
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    with runner.hold_resident() as held:  # a first pass prepares each layer's step (from its views)
        await compute_pool().run(lambda: [held.moe(l, runner.route_in_job(l, x)) for l in store.layout.layers])
    _executor.row_ffn_out_at = slow
    out = []
    def job():
        for layer in store.layout.layers:
            try:
                y = held.moe(layer, runner.route_in_job(layer, x))
                out.append("finite" if y is not None and np.isfinite(y).all() else repr(y))
            except Exception as exc:
                out.append(type(exc).__name__)
    async def close():
        await asyncio.sleep(0.1)
        await store.aclose()
    with runner.hold_resident() as held:
        closing = asyncio.ensure_future(close())
        await compute_pool().run(job)
        await closing
    print(json.dumps(out))

asyncio.run(main())
"""


def test_a_store_closed_during_a_held_pass_never_leaves_it_computing_on_unmapped_memory(tmp_path: Path) -> None:
    """The store closes while a held pass computes a layer from its table: that layer finishes on
    memory the table keeps mapped, the next ones raise StoreClosedError; no crash (in a child
    process, so that a segfault fails the test instead of ending the run)."""
    run = subprocess.run(
        [sys.executable, "-c", _CLOSE_DURING_PASS, str(tmp_path / "small.gguf")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out[0] == "finite"
    assert "StoreClosedError" in out[1:], out
    assert set(out) <= {"finite", "StoreClosedError"}, out


_FIRST_DECODE_COMPILES = r"""
import json, sys
import anyio
import numba.core.dispatcher as dispatcher
import aioexperts
from aioexperts._compute.pool import configure_compute_pool

path, threads, n_prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
configure_compute_pool(threads)

async def main():
    async with aioexperts.load(path, n_ctx=64) as model:
        store = model.store
        for layer, moe in store.layout.layers.items():
            async with store.experts(layer, range(moe.n_experts)):
                pass
        async with model.sequence() as seq:
            logits = (await seq.forward([(11 * i) % 64 for i in range(n_prompt)]))[-1]
            compiled = []
            plain = dispatcher._DispatcherBase._compile_for_args

            def spy(self, *args, **kw):
                compiled.append(getattr(self, "py_func", self).__name__)
                return plain(self, *args, **kw)

            dispatcher._DispatcherBase._compile_for_args = spy
            await seq.forward([int(logits.argmax())])
            dispatcher._DispatcherBase._compile_for_args = plain
    print(json.dumps(compiled))

anyio.run(main)
"""


@needs
@pytest.mark.parametrize(("threads", "n_prompt"), [(2, 40), (1, 5)])
def test_a_first_decode_token_in_a_fresh_process_compiles_nothing(threads: int, n_prompt: int) -> None:
    """In a fresh process (numba's compiled signatures are per process): after a prompt whose flash
    attention fanned out while the decode's does not (40 positions, 4 heads), and on a pool of one
    thread (every fan-out inline), the first decode token loads no kernel: `warm_decode_kernels`
    loaded the one-call flash attention and `run_inline` at load."""
    path = FIXTURES.get("qwen3moe-q4_k_m")
    if path is None:
        pytest.skip("qwen3moe-q4_k_m not among the fixtures")
    run = subprocess.run(
        [sys.executable, "-c", _FIRST_DECODE_COMPILES, str(path), str(threads), str(n_prompt)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []


@needs
async def test_a_first_decode_step_after_load_makes_no_step_and_compiles_nothing(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a first decode step would make per layer is made at load (each GQA block's prepared
    attention step, each router's one-row plan) or after the prefill (each layer's expert table and
    expert step), and every kernel the held pass calls was compiled or loaded then: the first
    decode token makes no step or table and compiles nothing (a kernel's first call, loaded from
    the cache, costs several milliseconds there)."""
    import numba.core.dispatcher as dispatcher

    from aioexperts._cache.cache import ExpertCache
    from aioexperts._compute import moe
    from aioexperts._model.blocks import GQABlock

    async with aioexperts.load(FIXTURES["qwen3moe-q4_k_m"], n_ctx=64) as model:
        parts = compute_pool().n_threads
        blocks = [layer.block for layer in model.forward_pass.weights.layers]
        assert blocks and all(isinstance(b, GQABlock) for b in blocks)
        from aioexperts._compute import fused

        key = (parts, fused.precision(), fused.backend().name)
        assert all(key in b._row_steps for b in blocks)  # made (None where no prepared step serves)
        residents = model.runner.router.residents.values()
        assert all(r._row_plans for r in residents)
        await load_every_expert(model)
        async with model.sequence() as seq:
            logits = (await seq.forward([11, 22, 33, 44, 55]))[-1]
            compiled: list[str] = []
            plain = dispatcher._DispatcherBase._compile_for_args

            def spy(self: object, *args: object, **kw: object) -> object:
                compiled.append(getattr(self, "py_func", self).__name__)  # type: ignore[attr-defined]
                return plain(self, *args, **kw)  # type: ignore[arg-type]

            made: list[object] = []
            prepare = GQABlock.prepare_decode
            for_layout = moe._row_step_for_layout
            ready_all = ExpertCache.ready_full_all
            monkeypatch.setattr(dispatcher._DispatcherBase, "_compile_for_args", spy)
            monkeypatch.setattr(GQABlock, "prepare_decode", lambda self, n: made.append(n) or prepare(self, n))
            monkeypatch.setattr(moe, "_row_step_for_layout", lambda *a: made.append("step") or for_layout(*a))
            monkeypatch.setattr(
                ExpertCache, "ready_full_all", lambda self, keys: made.append("table") or ready_all(self, keys)
            )
            jobs = compute_pool().statistics().jobs
            await seq.forward([int(logits.argmax())])
            assert compute_pool().statistics().jobs - jobs == 2  # the embedding, then the held pass
            assert compiled == [] and made == []
            steps = model.runner._executor._row_steps[(fused.precision(), fused.backend().name)]
            assert sorted(steps) == sorted(model.runner.router.residents)  # a step for every layer


@needs
@pytest.mark.parametrize("switch", ["backend", "precision"])
async def test_a_switch_of_kernels_or_precision_after_load_is_what_decodes(
    switch: str, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attention steps made at load serve the kernels and precision of load: after
    ``set_backend("numpy")`` or ``set_precision("float")`` a decode computes as a model loaded
    after the switch does (bit for bit), not with the prepared int8 step (qwen3moe-q8_0's Q8_0
    attention has one)."""
    from aioexperts._compute import fused

    path = FIXTURES.get("qwen3moe-q8_0")
    if path is None:
        pytest.skip("qwen3moe-q8_0 not among the fixtures")
    tokens = [11, 22, 33, 44, 55, 6]

    def switch_on() -> None:
        if switch == "backend":
            fused.set_backend("numpy")
        else:
            fused.set_precision("float")

    async def decode_logits(model: aioexperts.Model) -> np.ndarray:
        async with model.sequence() as seq:
            return np.concatenate([await seq.forward([t]) for t in tokens])

    try:
        switch_on()
        async with aioexperts.load(path, n_ctx=64) as model:
            want = await decode_logits(model)
        fused.set_backend(None)
        fused.set_precision(None)
        async with aioexperts.load(path, n_ctx=64) as model:
            before = await decode_logits(model)
            switch_on()
            got = await decode_logits(model)
    finally:
        fused.set_backend(None)
        fused.set_precision(None)
    assert not np.array_equal(before, want)  # the switch changes the numbers: the test can tell
    assert np.array_equal(got, want)
