"""The read shapes of DeepSeek-V4-class models: a 12 MiB Q2_K expert in split reads, and an Engram-style
per-token row table (one Q2_K block of 84 bytes per row, 48 rows per token) read through ``store.rows``.

Both are compared byte for byte with a plain ``pread`` of the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf_bytes as gb
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from ioutil import pread_segment

import aioexperts
from aioexperts.testing import FakeBackend, tiny_moe_writer

pytestmark = pytest.mark.anyio

Q = GGMLQuantizationType
T = GGUFValueType

# a DeepSeek-V4-sized routed expert: 4096 x 3072, Q2_K, gate + up + down = 11.8 MiB
N_EMBD, N_FF, N_EXPERT = 4096, 3072, 2
SPLIT_BYTES = 1 << 20


def _q2k_bytes(n_values: int, rng: np.random.Generator) -> bytes:
    block, size = GGML_QUANT_SIZES[Q.Q2_K]
    return rng.bytes(n_values // block * size)  # any bytes are a valid Q2_K block


@pytest.fixture(scope="module")
def big_expert_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One deepseek4 MoE block with two 11.8 MiB Q2_K experts (the keys of deepseek4.cpp's loader)."""
    rng = np.random.default_rng(4)
    path = tmp_path_factory.mktemp("v4") / "deepseek4-big-expert.gguf"
    f = gb.GGUFBytes(alignment=4096).add("general.architecture", T.STRING, "deepseek4")
    f.add("general.alignment", T.UINT32, 4096)  # the data is laid out so: say it (llama.cpp's offset rule)
    for key, value in {"block_count": 1, "embedding_length": N_EMBD, "expert_count": N_EXPERT,
                       "expert_used_count": 1, "expert_feed_forward_length": N_FF, "expert_shared_count": 1,
                       "expert_gating_func": 4, "hash_layer_count": 0}.items():  # fmt: skip
        f.add(f"deepseek4.{key}", T.UINT32, value)
    f.add("deepseek4.expert_weights_scale", T.FLOAT32, 1.5).add("deepseek4.expert_weights_norm", T.BOOL, True)
    f.add("deepseek4.swiglu_clamp_exp", T.FLOAT32, 10.0)
    f.tensors.append(gb.Tensor("blk.0.ffn_gate_inp.weight", [N_EMBD, N_EXPERT]))
    f.tensors.append(gb.Tensor("blk.0.exp_probs_b.bias", [N_EXPERT]))
    for proj, dims in (("gate", [N_EMBD, N_FF, N_EXPERT]), ("up", [N_EMBD, N_FF, N_EXPERT]),
                       ("down", [N_FF, N_EMBD, N_EXPERT])):  # fmt: skip
        data = _q2k_bytes(N_EMBD * N_FF * N_EXPERT, rng)
        f.tensors.append(gb.Tensor(f"blk.0.ffn_{proj}_exps.weight", dims, Q.Q2_K, data))
    path.write_bytes(f.build())
    return path


def _fake_factory(made: list[FakeBackend]):  # type: ignore[no-untyped-def]
    def factory(files, slab, loop, depth):  # type: ignore[no-untyped-def]
        made.append(FakeBackend(files, slab, loop, depth, order="reverse"))
        return made[-1]

    return factory


@pytest.mark.parametrize("backend", ["io_uring", "threads", "fake-reverse"])
async def test_a_deepseek_v4_sized_expert_streams_in_split_reads(
    big_expert_model: Path, backend: str, anyio_backend: object
) -> None:
    made: list[FakeBackend] = []
    chosen = _fake_factory(made) if backend == "fake-reverse" else backend
    io = aioexperts.IOOptions(backend=chosen, split_bytes=SPLIT_BYTES)  # type: ignore[arg-type]
    async with aioexperts.open(big_expert_model, slots=1, io=io) as store:
        model, layout = store.model, store.layout
        assert store.hparams.arch == "deepseek4"
        for expert in range(N_EXPERT):
            loc = layout.locate(0, expert)
            assert sum(seg.n_bytes for seg in loc.segments) == 3 * N_EMBD * N_FF // 256 * 84  # 11.8 MiB
            async with store.experts(0, [expert]) as views:
                (view,) = views
                assert view is not None
                for seg, proj in zip(loc.segments, (view.gate, view.up, view.down), strict=True):
                    assert bytes(proj.data) == pread_segment(model, seg), (expert, seg)
        assert store.statistics().misses == N_EXPERT
    if made:  # the reads of one expert went out as chunks of at most SPLIT_BYTES, together
        sizes = [op.n_bytes for op, _ in made[0].completed]
        assert len(sizes) >= N_EXPERT * 12 and max(sizes) <= SPLIT_BYTES
        assert max(made[0].batches) >= 12


# --------------------------------------------------------------------------------------------------
# Engram-style row table

ROW_VALUES = 256  # one Q2_K block per row: 84 bytes
ROWS_PER_TOKEN = 48
N_TABLE_ROWS = 1 << 17  # 128 Ki rows, 10.5 MiB: far larger than the row cache windows a token touches


def engram_rows(token_id: int, n_rows: int = N_TABLE_ROWS) -> list[int]:
    """The 48 rows of one token: multiplicative hashes of the id, one per head (the V4.1 runtime's scheme
    of picking rows by id; the exact hash does not matter to the reads)."""
    return [int((token_id * 0x9E3779B1 + head * 0x85EBCA77) % n_rows) for head in range(ROWS_PER_TOKEN)]


@pytest.fixture(scope="module")
def engram_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("engram") / "engram.gguf"
    rng = np.random.default_rng(1)
    w = tiny_moe_writer(path, rng)
    raw = rng.integers(0, 256, (N_TABLE_ROWS, 84), dtype=np.uint8)
    w.add_tensor("engram.weight", raw, raw_shape=(N_TABLE_ROWS, 84), raw_dtype=Q.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


async def test_engram_rows_per_token_equal_pread(engram_model: Path, anyio_backend: object) -> None:
    info = aioexperts.open_model(engram_model).tensor("engram.weight")
    assert info.ggml_type == Q.Q2_K and info.n_bytes == N_TABLE_ROWS * 84
    fd = os.open(engram_model, os.O_RDONLY)
    try:
        async with aioexperts.open(engram_model, slots=2) as store:
            for token_id in (0, 1, 151_643, 7, 7, 129_279):  # a repeat: served from the row cache
                ids = engram_rows(token_id)
                async with store.rows("engram.weight", ids) as rows:
                    assert rows.ggml_type == Q.Q2_K and rows.n_cols == ROW_VALUES
                    assert rows.row_ids == tuple(ids)
                    for row, data in zip(ids, rows.data, strict=True):
                        assert bytes(data) == os.pread(fd, 84, info.data_offset + row * 84), (token_id, row)
            st = store.row_statistics()
            assert st is not None and st.rows == 6 * ROWS_PER_TOKEN and st.useful_bytes == st.rows * 84
            assert st.window_hits >= ROWS_PER_TOKEN // 2  # the repeated token's windows were cached
    finally:
        os.close(fd)
