"""Door (b): the tokenizer on arbitrary text (any code point, lone surrogates too), any value, and any ids.

``encode`` either gives ids in the vocabulary or raises ``TokenizerError``; ``decode`` of those ids, whole
or through the incremental decoder, gives the same text; for byte-level BPE vocabularies without
llama.cpp's space cleaning it gives the text back exactly. ``decode`` of arbitrary ids raises only
``TokenizerError``.
"""

from __future__ import annotations

import random

import fuzzkit as kit
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from aioexperts import Tokenizer

#: the two tiny synthetic vocabularies, and one BPE and one SPM vocabulary of llama.cpp's (when present)
NAMES = ("tiny-gpt2", "tiny-spm", "qwen2", "llama-spm")

any_text = st.text(st.characters(codec=None, categories=None), max_size=200)  # surrogates included
ids = st.lists(
    st.one_of(st.integers(-5, 200_000), st.integers(), st.booleans(), st.none(), st.floats(), st.text(max_size=2)),
    max_size=20,
)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    return kit.load_tokenizers(NAMES)


@pytest.fixture(params=NAMES)
def tok(request: pytest.FixtureRequest, tokenizers: dict[str, Tokenizer]) -> Tokenizer:
    if request.param not in tokenizers:
        pytest.skip(f"vocabulary {request.param} not found (../shared/vocab)")
    return tokenizers[request.param]


def _run(tok: Tokenizer, text: object, token_ids: list[object], flags: int) -> None:
    try:
        event(kit.tokenizer_door(tok, text, token_ids, flags))
    except kit.Unexpected as exc:
        raise exc.cause from exc


@kit.FUZZ
@given(text=any_text, token_ids=ids, flags=st.integers(0, 7))
def test_fuzz_any_text(tok: Tokenizer, text: str, token_ids: list[object], flags: int) -> None:
    _run(tok, text, token_ids, flags)


@kit.FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_pieces(tok: Tokenizer, rnd: random.Random) -> None:
    """Special-token texts, whitespace runs, combining marks, emoji sequences, long repeats."""
    _run(tok, kit.random_text(rnd), kit.random_ids(rnd, tok.n_vocab), rnd.randrange(8))


@kit.FUZZ
@given(raw=st.binary(max_size=64), flags=st.integers(0, 7))
def test_fuzz_bytes(tok: Tokenizer, raw: bytes, flags: int) -> None:
    """Bytes are refused; the same bytes as text (undecodable ones as lone surrogates) are tokenized or refused."""
    _run(tok, raw, [], flags)
    _run(tok, raw.decode("utf-8", "surrogateescape"), [], flags)
    _run(tok, raw.decode("latin-1"), [], flags)


@kit.FUZZ
@given(value=st.one_of(st.none(), st.integers(), st.lists(st.text(max_size=3)), st.binary(max_size=4)))
def test_fuzz_not_text(tok: Tokenizer, value: object) -> None:
    _run(tok, value, [], 3)
