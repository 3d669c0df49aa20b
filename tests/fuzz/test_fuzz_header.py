"""Door (a): the GGUF header and tensor table reader on mutated, structured and random bytes.

Each input is written to a file and opened as a model (``open_model``, ``build_layout``, the MoE
hyper-parameters), as a vocabulary (``Tokenizer.from_gguf``) and as a chat template
(``ChatTemplate.from_gguf``): only ``AioExpertsError`` subclasses may come out, and whatever parses
stays inside its file. The reader's memory is bounded by the file size even when counts claim more.
"""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path

import fuzzkit as kit
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from aioexperts._format.header import read_header
from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model

#: the header reader's peak memory for an input of n bytes is at most this many times n, plus ...
MEMORY_FACTOR = 64
#: ... this many bytes
MEMORY_CONSTANT = 256 << 10


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("fuzz-header"))


def _run(data: bytes, work: str) -> None:
    try:
        event(kit.header_door(data, work))
    except kit.Unexpected as exc:
        raise exc.cause from exc


def test_seeds_are_valid(work: str) -> None:
    for seed in kit.seeds():
        path = Path(work) / f"{seed.name}.gguf"
        path.write_bytes(seed.data)
        model = open_model(path)
        if seed.name.startswith("moe"):
            assert len(build_layout(model).layers) == 2
        assert kit.header_door(seed.data, work) == "ok"


@kit.FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_mutated_seeds(work: str, rnd: random.Random) -> None:
    _run(kit.mutate(rnd, rnd.choice(kit.seeds())), work)


@kit.FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_structured(work: str, rnd: random.Random) -> None:
    _run(kit.structured(rnd), work)


@kit.FUZZ
@given(data=st.one_of(st.binary(max_size=256), st.binary(max_size=256).map(lambda b: b"GGUF\x03\x00\x00\x00" + b)))
def test_fuzz_random_bytes(work: str, data: bytes) -> None:
    _run(data, work)


@kit.FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_memory_bounded_by_input_size(work: str, rnd: random.Random) -> None:
    """Counts and lengths that claim far more than the file holds allocate nothing for them."""
    data = kit.huge_count_input(rnd)
    path = Path(work) / "huge.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        try:
            read_header(str(path))
        except kit.AioExpertsError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= MEMORY_FACTOR * len(data) + MEMORY_CONSTANT, (len(data), peak)
