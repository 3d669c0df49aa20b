"""Door (b): the tokenizer on arbitrary text (any code point, lone surrogates too), any value, and any ids.

``encode`` either gives ids in the vocabulary or raises ``TokenizerError``; ``decode`` of those ids, whole
or through the incremental decoder, gives the same text; for byte-level BPE vocabularies without
llama.cpp's space cleaning it gives the text back exactly. ``decode`` of arbitrary ids raises only
``TokenizerError``.
"""

from __future__ import annotations

import itertools
import random
import time

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


# regressions the fuzzer found


@pytest.fixture(scope="module")
def cleaning(tokenizers: dict[str, Tokenizer]) -> Tokenizer:
    tok = tokenizers["tiny-gpt2"]
    assert tok._clean_spaces  # gpt-2's pre-tokenizer cleans spaces, as llama.cpp's
    return tok


def test_incremental_decoder_is_linear_on_spaces(cleaning: Tokenizer) -> None:
    """Held-back text was searched for a safe cut from its end on every id: a run of spaces (never cut)
    made streaming quadratic (seconds for a few thousand ids)."""
    ids = cleaning.encode("ab" + " " * 6000 + "cd", add_special=False)
    ids = [i for t in ids for i in cleaning.encode(cleaning.decode([t]), add_special=False)]  # one id per space
    dec = cleaning.decoder()
    t0 = time.thread_time()
    text = "".join(dec.feed(i) for i in ids) + dec.flush()
    assert time.thread_time() - t0 < 2.0
    assert text == cleaning.decode(ids)


def test_incremental_decoder_streams_spaced_text(cleaning: Tokenizer) -> None:
    """Text with a space or quote in every four characters ("1 2 3 4 ...") was held back until flush."""
    ids = cleaning.encode(" ".join("123456789" * 4) + " it's 'a' b .", add_special=False)
    dec = cleaning.decoder()
    parts = [dec.feed(i) for i in ids]
    assert sum(map(len, parts)) > 60  # streamed, not all held back
    assert "".join(parts) + dec.flush() == cleaning.decode(ids)


@pytest.mark.parametrize("n", [5])
def test_safe_cut_exhaustive(n: int) -> None:
    """Every cut the decoder may make keeps clean_spaces(left) + clean_spaces(right) == clean_spaces(whole)."""
    from aioexperts._text.tokenizer import _clean_spaces, _safe_cut

    for length in range(2, n + 1):
        for chars in itertools.product(" '.srea\0", repeat=length):
            text = "".join(chars)
            whole = _clean_spaces(text)
            for end in range(2, length + 1):  # the cut _safe_cut picks in every prefix
                cut = _safe_cut(text[:end])
                if cut:
                    assert _clean_spaces(text[:cut]) + _clean_spaces(text[cut:]) == whole, (text, cut)
