"""NextN / MTP blocks (``{arch}.nextn_predict_layers``) are not MoE layers of the forward pass.

glm4moe (and bailingmoe2, GLM-4.7's deepseek2 files) store the multi-token-prediction block(s) as the
last blocks, with full expert tensors; llama.cpp loads them with ``TENSOR_SKIP`` and its graph stops
before them. They must not be in ``store.layout.layers``, be prefetched, or be run per token.
"""

from __future__ import annotations

from pathlib import Path

import gguf_bytes as gb
import numpy as np
import pytest
from gguf import GGUFValueType
from moe_session import moe_session

from aioexperts._errors import InvalidRequestError, LayoutError
from aioexperts._format.hparams import MoEHParams
from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model

T = GGUFValueType
N_EMBD, N_FF, N_EXPERT = 32, 32, 4


def _glm4moe(path: Path, *, block_count: int = 4, nextn: int = 1, moe_blocks: tuple[int, ...] = (1, 2, 3)) -> Path:
    """Block 0 dense, then MoE blocks; the last ``nextn`` blocks are NextN blocks with experts."""
    rng = np.random.default_rng(0)
    f = gb.GGUFBytes()
    f.add("general.architecture", T.STRING, "glm4moe")
    for key, value in (
        ("block_count", block_count),
        ("embedding_length", N_EMBD),
        ("feed_forward_length", 64),
        ("expert_count", N_EXPERT),
        ("expert_used_count", 2),
        ("expert_feed_forward_length", N_FF),
        ("expert_shared_count", 0),
        ("leading_dense_block_count", 1),
        ("nextn_predict_layers", nextn),
    ):
        f.add(f"glm4moe.{key}", T.UINT32, value)

    def rand(*dims: int) -> bytes:
        return (rng.standard_normal(int(np.prod(dims))) * 0.2).astype(np.float32).tobytes()

    f.tensors = [gb.Tensor("blk.0.ffn_up.weight", [N_EMBD, 64], data=rand(N_EMBD, 64))]
    for b in moe_blocks:
        f.tensors += [
            gb.Tensor(f"blk.{b}.ffn_gate_inp.weight", [N_EMBD, N_EXPERT], data=rand(N_EMBD, N_EXPERT)),
            gb.Tensor(f"blk.{b}.ffn_gate_exps.weight", [N_EMBD, N_FF, N_EXPERT], data=rand(N_EMBD, N_FF, N_EXPERT)),
            gb.Tensor(f"blk.{b}.ffn_up_exps.weight", [N_EMBD, N_FF, N_EXPERT], data=rand(N_EMBD, N_FF, N_EXPERT)),
            gb.Tensor(f"blk.{b}.ffn_down_exps.weight", [N_FF, N_EMBD, N_EXPERT], data=rand(N_FF, N_EMBD, N_EXPERT)),
        ]
    for b in range(block_count - nextn, block_count):
        f.tensors.append(gb.Tensor(f"blk.{b}.nextn.eh_proj.weight", [2 * N_EMBD, N_EMBD]))
    path.write_bytes(f.build())
    return path


def test_nextn_block_is_left_out_of_the_layout(tmp_path: Path) -> None:
    model = open_model(_glm4moe(tmp_path / "m.gguf"))
    layout = build_layout(model)
    assert list(layout.layers) == [1, 2]
    assert layout.nextn_layers == (3,)
    assert not layout.include_nextn
    assert layout.n_experts_total == 2 * N_EXPERT
    with pytest.raises(InvalidRequestError, match=r"no MoE layer 3; MoE layers are 1\.\.2 \(a NextN/MTP block"):
        layout.layer(3)
    hp = MoEHParams.from_metadata(model.architecture, model.metadata)
    assert [hp.is_nextn_layer(b) for b in range(5)] == [False, False, False, True, False]
    assert hp.is_moe_layer(3)  # it has experts; the layout is what leaves it out


def test_include_nextn_keeps_the_nextn_block(tmp_path: Path) -> None:
    layout = build_layout(open_model(_glm4moe(tmp_path / "m.gguf")), include_nextn=True)
    assert list(layout.layers) == [1, 2, 3]
    assert layout.nextn_layers == (3,)
    assert layout.include_nextn
    assert layout.locate(3, 1).expert == 1


def test_two_nextn_blocks(tmp_path: Path) -> None:
    layout = build_layout(open_model(_glm4moe(tmp_path / "m.gguf", block_count=5, nextn=2, moe_blocks=(1, 2, 3, 4))))
    assert list(layout.layers) == [1, 2]
    assert layout.nextn_layers == (3, 4)


@pytest.mark.parametrize("nextn", [4, 9])
def test_nextn_count_not_below_block_count_is_refused(tmp_path: Path, nextn: int) -> None:
    model = open_model(_glm4moe(tmp_path / "m.gguf", nextn=nextn, moe_blocks=(1,)))
    with pytest.raises(LayoutError, match=rf"nextn_predict_layers={nextn} needs glm4moe\.block_count above it"):
        build_layout(model)


@pytest.mark.anyio
async def test_the_runner_never_reads_prefetches_or_runs_the_nextn_block(tmp_path: Path, anyio_backend: object) -> None:
    path = _glm4moe(tmp_path / "m.gguf")
    x = np.random.default_rng(1).standard_normal((3, N_EMBD)).astype(np.float32)
    async with moe_session(path, slots=2 * N_EXPERT, record_trace=True) as session:
        assert list(session.layout.layers) == [1, 2]
        assert session.upcoming_layers(2) == [1]  # wraps to the next token's first layer, not to block 3
        await session.warmup()  # the resident weights of blocks 1 and 2 (block 3 is never loaded)
        result = await session.run_moe_layers(x)
        await session.run_moe_layers(x)
        assert [step.layer for step in result.steps] == [1, 2]
        with pytest.raises(InvalidRequestError, match="NextN"):
            await session.moe(3, x)
        trace = session.routing_trace()
    assert list(trace.layers) == [1, 2]


@pytest.mark.anyio
async def test_a_store_serves_the_nextn_block_when_asked(tmp_path: Path, anyio_backend: object) -> None:
    import aioexperts

    path = _glm4moe(tmp_path / "m.gguf")
    async with aioexperts.open(path, slots=4) as store:
        assert 3 not in store.layout.layers
        with pytest.raises(aioexperts.InvalidRequestError, match="NextN"):
            async with store.experts(3, [0]):
                pass
    async with aioexperts.open(path, slots=4, include_nextn=True) as store:
        assert 3 in store.layout.layers
        async with store.experts(3, [0]) as (view,):
            assert view is not None and view.layer == 3
