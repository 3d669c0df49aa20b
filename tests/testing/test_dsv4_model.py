"""The built-in DeepSeek-V4-geometry model's writer (aioexperts.testing._dsv4_model), at a test size."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

import aioexperts
from aioexperts._model.dsv4_block import DSV4Block
from aioexperts.testing import DSV4_SPEC, TINY_DSV4_SPEC, write_dsv4_model

pytest.importorskip("tokenizers")

TINY = TINY_DSV4_SPEC  # DeepSeek-V4-Flash's layout at a test size


def test_the_default_is_deepseek_v4_flash_s_geometry() -> None:
    s = DSV4_SPEC
    assert (s.n_embd, s.n_head, s.head_dim, s.n_rot, s.q_lora_rank, s.o_groups, s.o_lora_rank) == (
        4096, 64, 512, 64, 1024, 8, 1024,
    )  # fmt: skip
    assert (s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_hash_layers, s.idx_heads, s.idx_top_k) == (
        256,
        6,
        2048,
        3,
        64,
        512,
    )
    assert s.compress_ratios == [0, 0, 4, 128]
    assert s.file_name() != TINY.file_name() and TINY.file_name() == TINY.file_name()


def test_a_tiny_one_loads_and_generates(tmp_path: Path) -> None:
    path = write_dsv4_model(tmp_path / "dsv4.gguf", TINY)

    async def main() -> tuple[list[int], list[int], np.ndarray]:
        async with aioexperts.load(path, io=aioexperts.IOOptions(backend="threads"), slots=16) as model:
            assert model.forward_pass.weights.hyper is not None
            ratios = [
                layer.block.ratio for layer in model.forward_pass.weights.layers if isinstance(layer.block, DSV4Block)
            ]
            assert ratios == [0, 0, 4, 128]
            prompt = model.tokenizer.encode("Once upon a time there was a compressed attention model " * 4)
            async with model.sequence() as seq:
                logits = await seq.forward(prompt)
            eog = sorted(model.hparams.eog_ids)

            def no_eog(logits: np.ndarray, history: object) -> int:  # greedy; random weights may pick EOS
                return int(np.argmax(np.where(np.isin(np.arange(len(logits)), eog), -np.inf, logits)))

            greedy = [t async for t in model.generate(prompt, max_tokens=6, sampler=no_eog)]
            again = [t async for t in model.generate(prompt, max_tokens=6, sampler=no_eog)]
        return greedy, again, logits

    greedy, again, logits = anyio.run(main)
    assert np.isfinite(logits).all() and logits.std() > 0.1
    assert len(greedy) == 6 and greedy == again


def test_ensure_writes_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aioexperts.testing import dsv4_model_path, ensure_dsv4_model

    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path / "cache"))
    assert dsv4_model_path(6) == tmp_path / "cache" / DSV4_SPEC.with_(n_layer=6).file_name()
    built: list[Path] = []
    first = ensure_dsv4_model(spec=TINY, on_build=built.append)
    assert first == tmp_path / "cache" / TINY.file_name() and built == [first]
    stamp = first.stat().st_mtime_ns
    assert ensure_dsv4_model(spec=TINY, on_build=built.append) == first  # reused, not written again
    assert built == [first] and first.stat().st_mtime_ns == stamp
    with pytest.raises(aioexperts.ConfigError, match="n_layer"):
        ensure_dsv4_model(0)
