"""The incremental decoder: its pieces, concatenated, are ``decode`` of all ids, and never half a character."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vocab_testkit import tokenizer, vocab_dir

from aioexperts import IncrementalDecoder, Tokenizer

# multi-byte characters (2, 3, 4 UTF-8 bytes), spaces, quotes and the punctuation clean_spaces touches
ALPHABET = st.sampled_from(list("ab xyzé€😀 ,.!?'\n\tñ中文ü") + ["  ", " '", "'s ", " 're", "🦙", "\u200d"])
TEXTS = st.lists(ALPHABET, min_size=1, max_size=40).map("".join)
#: gpt-2: byte-level BPE with clean_spaces; qwen2: without; llama-spm: SentencePiece with byte fallback
VOCABS = ["ggml-vocab-gpt-2.gguf", "ggml-vocab-qwen2.gguf", "ggml-vocab-llama-spm.gguf"]


def _tokenizer(name: str) -> Tokenizer:
    root = vocab_dir()
    if root is None or not (root / name).exists():
        pytest.skip(f"no {name} (../shared/vocab)")
    return tokenizer(Path(root) / name)


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], *, skip_special: bool = False) -> list[str]:
    dec = tok.decoder(skip_special=skip_special)
    assert isinstance(dec, IncrementalDecoder)
    pieces, i = [], 0
    for size in chunks:
        if i >= len(ids):
            break
        pieces.append(dec.feed(ids[i : i + size] if size > 1 else ids[i]))
        i += max(size, 1)
    pieces.append(dec.feed(ids[i:]))
    pieces.append(dec.flush())
    return pieces


@pytest.mark.parametrize("name", VOCABS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, chunks=st.lists(st.integers(1, 3), max_size=60))
def test_stream_of_encoded_text_equals_decode(name: str, text: str, chunks: list[int]) -> None:
    tok = _tokenizer(name)
    ids = tok.encode(text, add_special=False)
    pieces = _stream(tok, ids, chunks)
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # no piece ends inside a character


@pytest.mark.parametrize("name", VOCABS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stream_of_any_ids_equals_decode(name: str, data: st.DataObject) -> None:
    """Any id sequence (byte tokens that make invalid UTF-8, control tokens): the same text either way."""
    tok = _tokenizer(name)
    ids = data.draw(st.lists(st.integers(0, tok.n_vocab - 1), max_size=30))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=30))
    skip = data.draw(st.booleans())
    assert "".join(_stream(tok, ids, chunks, skip_special=skip)) == tok.decode(ids, skip_special=skip)


def test_a_character_split_over_byte_tokens_comes_out_whole() -> None:
    """SPM byte fallback: '😀' is four ``<0xXX>`` tokens; nothing comes out until the fourth."""
    tok = _tokenizer("ggml-vocab-llama-spm.gguf")
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    assert None not in ids
    dec = tok.decoder()
    assert [dec.feed(i) for i in ids] == ["", "", "", "😀"]  # type: ignore[arg-type]
    assert dec.flush() == ""


def test_a_space_before_punctuation_waits_for_the_next_token() -> None:
    """gpt-2's clean_spaces: ``" ,"`` decodes to ``","``, so a trailing space is held until it is known."""
    tok = _tokenizer("ggml-vocab-gpt-2.gguf")
    ids = tok.encode("Hello ,world", add_special=False)
    assert tok.decode(ids) == "Hello,world"
    assert "".join(_stream(tok, ids, [1] * len(ids))) == "Hello,world"


def test_flush_gives_an_unfinished_character_as_replacement() -> None:
    tok = _tokenizer("ggml-vocab-llama-spm.gguf")
    first = tok.token_to_id("<0xF0>")
    assert first is not None
    dec = tok.decoder()
    assert dec.feed(first) == ""
    assert dec.flush() == "\ufffd" == tok.decode([first])
