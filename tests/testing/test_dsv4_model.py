"""The built-in DeepSeek-V4-geometry model's writer (aioexperts.testing._dsv4_model), at a test size."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

import aioexperts
from aioexperts._model.dsv4_block import DSV4Block
from aioexperts.testing._dsv4_model import DSV4_SPEC, DSV4Spec, write_dsv4_model

pytest.importorskip("tokenizers")

#: DeepSeek-V4-Flash's layout at a test size: the window, CSA and HCA layers, hash-routed and routed layers
TINY = DSV4Spec(
    n_layer=4, n_embd=256, n_head=4, head_dim=128, n_rot=32, q_lora_rank=256, o_groups=2, o_lora_rank=128,
    n_expert=8, n_expert_used=3, n_ff_exp=256, n_hash_layers=3, idx_heads=8, idx_dim=64, idx_top_k=4,
    window=16, sinkhorn_iters=5, vocab_size=512, context_length=4096,
)  # fmt: skip


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
