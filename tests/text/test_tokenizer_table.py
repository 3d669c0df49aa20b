"""The pre-tokenizer table: every row builds, splits without losing text, and is documented."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from vocab_testkit import REPO

from aioexperts._text import pretokenize

tokenizers = pytest.importorskip("tokenizers")

SAMPLE = "Hello World's 1234567 élan ÉCOLE 中文字 カタカナ 한국어 ½ \n\n  \t x<sentinel:12> IMGIMGABZ ... ?! 'RE\r\n"
LLAMA_SRC = Path(os.environ.get("AIOEXPERTS_LLAMA_SRC", "/work/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp"))


@pytest.mark.parametrize("pre", pretokenize.known_pre_values())
def test_every_pre_tokenizer_splits_without_losing_text(pre: str) -> None:
    row = pretokenize.lookup_pre(pre)
    assert row is not None and row.regexes
    splits = [
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(pretokenize.onig_pattern(r)), behavior="isolated")
        for r in row.regexes
    ]
    pieces = [p for p, _ in tokenizers.pre_tokenizers.Sequence(splits).pre_tokenize_str(SAMPLE)]
    assert "".join(pieces) == SAMPLE
    assert len(pieces) > 2


def test_onig_patterns_follow_llama_cpp_collapsing() -> None:
    """Letter-case classes cannot be told apart in llama.cpp's collapsed text; ``\\d`` is ASCII; ``$`` the end."""
    assert pretokenize.onig_pattern(r"[\p{Lu}\p{Ll}]+\d$") == r"[\p{L}\p{L}]+[0-9]\z"
    qwen2 = pretokenize.lookup_pre("qwen2")
    assert qwen2 is not None
    assert pretokenize.onig_pattern(qwen2.regexes[0]) == qwen2.regexes[0]  # a custom splitter's regex: as is


def test_unknown_pre_is_not_in_the_table() -> None:
    assert pretokenize.lookup_pre("no-such-pre") is None
    missing, default = pretokenize.lookup_pre(None), pretokenize.lookup_pre("default")
    assert missing is not None and default is not None
    assert (missing.type, missing.regexes) == (default.type, default.regexes)


def test_docs_name_every_pre_tokenizer() -> None:
    text = (REPO / "docs" / "text.md").read_text(encoding="utf-8")
    section = text.split("## Tokenizer", 1)[1]
    missing = [v for v in [*pretokenize.known_pre_values(), *pretokenize.UNSUPPORTED_PRE] if f"`{v}`" not in section]
    assert not missing


@pytest.mark.skipif(not (LLAMA_SRC / "src" / "llama-vocab.cpp").exists(), reason="no llama.cpp source")
def test_table_covers_every_pre_name_of_llama_cpp() -> None:
    """Every ``tokenizer_pre == "..."`` of llama.cpp's load() is in the table or refused by name."""
    src = (LLAMA_SRC / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    names = set(re.findall(r'tokenizer_pre == "([^"]+)"', src))
    assert len(names) > 50
    known = set(pretokenize.known_pre_values()) | set(pretokenize.UNSUPPORTED_PRE)
    assert names - known == set()
