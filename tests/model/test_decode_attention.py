"""A GQA block's prepared one-token attention (``_compute/decode_attention.py: RowAttention``) has the
bits of the general path (``GQABlock.attention_rows``) and steps aside where it cannot serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import shared_fixture_paths

import aioexperts
from aioexperts._compute import decode_attention, fused
from aioexperts._model import blocks

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(fused.backend().name != "numba", reason="the step needs numba's kernels"),
]

FIXTURES = {p.stem: p for p in shared_fixture_paths()}


class Served:
    """Counts RowAttention.run calls and those that returned the output."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = self.served = 0
        run = decode_attention.RowAttention.run

        def counted(step: decode_attention.RowAttention, *args: Any) -> np.ndarray | None:
            self.calls += 1
            y = run(step, *args)
            self.served += y is not None
            return y

        monkeypatch.setattr(decode_attention.RowAttention, "run", counted)


async def greedy_logits(path: Path, steps: int = 6) -> np.ndarray:
    async with aioexperts.load(path, slots=4096, n_ctx=128) as model:
        out = []
        async with model.sequence() as seq:
            logits = (await seq.forward([11, 22, 33, 44, 55]))[-1]
            for _ in range(steps):
                logits = (await seq.forward([int(logits.argmax())]))[-1]
                out.append(logits)
    return np.array(out)


def model_paths(tiny: Path) -> dict[str, Path]:
    paths = {"builtin-tiny": tiny}
    for name in ("qwen3moe-q8_0", "qwen3moe-mxfp4_moe"):  # q/k/v of one type: stacked, so served
        if name in FIXTURES:
            paths[name] = FIXTURES[name]
    return paths


@pytest.mark.parametrize("flash_split", ["fan-out", "one-call"])
async def test_the_prepared_step_has_the_general_paths_bits(
    tiny_full_model: Path, flash_split: str, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused, "FLASH_SPLIT_MIN", 1 if flash_split == "fan-out" else 1 << 40)
    for name, path in model_paths(tiny_full_model).items():
        served = Served(monkeypatch)
        got = await greedy_logits(path)
        assert served.served == served.calls > 0, name  # every decode layer took the step
        with monkeypatch.context() as m:
            m.setattr(blocks.GQABlock, "_row_attention", lambda self, parts: None)
            want = await greedy_logits(path)
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("name", ["qwen2moe-q4_k_m", "gpt-oss-f32", "olmoe-f32", "qwen3moe-f32"])
async def test_blocks_it_cannot_serve_take_the_general_path(
    name: str, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Biases (qwen2moe, gpt-oss), a whole-projection q/k norm (olmoe), float weights (no fan-out task)."""
    path = FIXTURES.get(name)
    if path is None:
        pytest.skip(f"{name} not among the fixtures")
    served = Served(monkeypatch)
    logits = await greedy_logits(path, steps=2)
    assert np.isfinite(logits).all()
    assert served.calls == 0


async def test_a_busy_step_or_arguments_that_do_not_fit_give_none(tiny_full_model: Path, anyio_backend: object) -> None:
    async with aioexperts.load(tiny_full_model, slots=4096, n_ctx=64) as model:
        block = model.forward_pass.weights.layers[0].block
        assert isinstance(block, blocks.GQABlock)
        step = block._row_attention(2)
        assert step is not None
        hp = model.hparams
        x = np.ones((1, hp.n_embd), dtype=np.float32)
        kc = np.zeros((8, hp.n_head_kv, hp.head_k), dtype=np.float16)
        vc = np.zeros((8, hp.n_head_kv, hp.head_v), dtype=np.float16)
        y = step.run(x, kc, vc, 0)
        assert y is not None and y.shape == (1, hp.n_embd) and np.isfinite(y).all()
        assert kc[0].any() and not kc[1:].any()  # the key written at its position only
        assert step.run(x, kc, vc, 8) is None  # past the cache
        assert step.run(x, kc.astype(np.float32), vc, 1) is None  # an F32 cache: the general path
        assert step.run(np.ones((2, hp.n_embd), np.float32), kc, vc, 1) is None  # two tokens
        bad = x.copy()
        bad[0, 3] = np.nan
        assert step.run(bad, kc, vc, 1) is None  # not finite: the general path raises its error
        assert not kc[1].any()  # nothing written
        step._busy.acquire()  # another thread's token
        try:
            assert step.run(x, kc, vc, 1) is None
        finally:
            step._busy.release()
        assert step.run(x, kc, vc, 1) is not None
