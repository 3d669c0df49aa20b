"""llama.cpp's own tokenizer test cases: every string of every vocabulary gives llama.cpp's ids.

The vocabularies and ids are in ``../shared/vocab`` (README there): ``<vocab>.gguf.inp`` / ``.out``,
tokenized by llama.cpp with ``add_special=false, parse_special=false``, and ``special-goldens.json``
(strings with control and user-defined tokens and rendered chat prompts, each combination of
``add_special`` and ``parse_special``). More folders of the same kind: ``$AIOEXPERTS_EXTRA_VOCAB``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vocab_testkit import read_cases, tokenizer, vocab_dir, vocab_params

from aioexperts._text.tokenizer import _clean_spaces


@pytest.mark.parametrize("path", vocab_params())
def test_every_string_gives_llama_cpp_ids(path: Path) -> None:
    tok = tokenizer(path)
    cases = read_cases(path)
    assert cases
    wrong = [
        (text, got, want)
        for text, want in cases
        if (got := tok.encode(text, add_special=False, parse_special=False) if text else []) != want
    ]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ from llama.cpp, first: {wrong[0]!r}"


@pytest.mark.parametrize("path", vocab_params())
def test_llama_cpp_ids_decode_to_the_string(path: Path) -> None:
    """``decode`` of llama.cpp's ids gives the input back, except where llama.cpp's detokenizer changes
    it on purpose (``clean_spaces``: no space before ``?!.,``): there it gives the cleaned string."""
    tok = tokenizer(path)
    for text, ids in read_cases(path):
        if not ids:
            continue
        want = _clean_spaces(text) if tok._clean_spaces else text
        assert tok.decode(ids) == want, text
        assert tok.decode(tok.encode(text, add_special=False)) == want


def _special_cases() -> list[object]:
    root = vocab_dir()
    if root is None or not (root / "special-goldens.json").exists():
        return [pytest.param(None, None, marks=pytest.mark.skip(reason="no special-goldens.json"))]
    goldens = json.loads((root / "special-goldens.json").read_text(encoding="utf-8"))
    return [
        pytest.param(root / name, cases, id=name.removeprefix("ggml-vocab-").removesuffix(".gguf"))
        for name, cases in sorted(goldens.items())
    ]


@pytest.mark.parametrize(("path", "cases"), _special_cases())
def test_special_tokens_and_chat_prompts_give_llama_cpp_ids(path: Path, cases: list[dict[str, object]]) -> None:
    tok = tokenizer(path)
    assert {(c["add_special"], c["parse_special"]) for c in cases} == {(a, p) for a in (0, 1) for p in (0, 1)}
    wrong = []
    for case in cases:
        text, add, parse = case["text"], case["add_special"], case["parse_special"]
        assert isinstance(text, str)
        got = tok.encode(text, add_special=bool(add), parse_special=bool(parse))
        if got != case["ids"]:
            wrong.append((text, add, parse, got, case["ids"]))
    assert not wrong, f"{len(wrong)} of {len(cases)} differ from llama.cpp, first: {wrong[0]!r}"


@pytest.mark.parametrize(("path", "cases"), _special_cases())
def test_parsed_special_tokens_decode_to_their_text(path: Path, cases: list[dict[str, object]]) -> None:
    """With the special tokens parsed, ``decode`` gives their text back; ``skip_special`` drops control tokens."""
    tok = tokenizer(path)
    for case in cases:
        ids = case["ids"]
        assert isinstance(ids, list)
        if not case["parse_special"] or case["add_special"]:
            continue
        text = tok.decode(ids)
        skipped = tok.decode(ids, skip_special=True)
        controls = [i for i in ids if tok.is_control(i)]
        for i in controls:
            assert tok.token_text(i) in text
        if controls:
            assert len(skipped) < len(text)
        else:
            assert skipped == text
