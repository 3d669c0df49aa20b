"""Bad input: each a clear error from the library's hierarchy, never a crash or a wrong answer."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from vocab_testkit import BYTE_CHARS, bpe_kv, spm_kv, write_vocab

import aioexperts
from aioexperts import FormatError, OptionalDependencyError, Tokenizer, TokenizerError, VocabularyError


def _tok(tmp_path: Path, kv: dict[str, object], name: str = "vocab.gguf") -> Tokenizer:
    return Tokenizer.from_gguf(write_vocab(tmp_path / name, kv))


def _drop(kv: dict[str, object], key: str) -> dict[str, object]:
    return {k: v for k, v in kv.items() if k != key}


def test_the_tiny_vocabularies_work(tmp_path: Path) -> None:
    """The synthetic vocabularies the error cases start from are good ones."""
    bpe = _tok(tmp_path, bpe_kv(), "bpe.gguf")
    g = {c: i for i, c in enumerate(BYTE_CHARS[b] for b in range(256))}
    the = bpe.token_to_id("Ġthe")
    assert bpe.encode(" the", add_special=False) == [the]
    assert bpe.encode("the<tool>", add_special=False) == [g["t"], 257, 260]  # user-defined: always split
    assert bpe.encode("<|endoftext|>", add_special=False) == [g[c] for c in "<|endoftext|>"]
    assert bpe.encode("<|endoftext|>", add_special=False, parse_special=True) == [259]
    assert bpe.decode([the, 260, 259]) == " the<tool><|endoftext|>"
    assert bpe.decode([the, 260, 259], skip_special=True) == " the<tool>"
    assert bpe.eog_ids == {259} and bpe.eot_id == 259  # "<|endoftext|>" found by its text, as llama.cpp does
    spm = _tok(tmp_path, spm_kv(), "spm.gguf")
    ids = {t: spm.token_to_id(t) for t in ("▁", "a", "b", "▁a", "ab")}
    # "▁ab▁a": "▁a" (score -0.5) merges before "ab" (-3.0), and "▁ab" is no token
    assert spm.encode("ab a") == [1, ids["▁a"], ids["b"], ids["▁a"]]
    assert spm.encode("b", add_special=False) == [ids["▁"], ids["b"]]
    assert spm.encode("c", add_special=False) == [259, 3 + ord("c")]  # ▁ then byte fallback <0x63>
    assert spm.decode(spm.encode("ab a", add_special=False)) == "ab a"


@pytest.mark.parametrize(
    ("kv", "needle"),
    [
        (bpe_kv(**{"tokenizer.ggml.model": "bert"}), "tokenizer.ggml.model 'bert' is not supported"),
        (bpe_kv(**{"tokenizer.ggml.model": "t5"}), "'t5' is not supported"),
        (bpe_kv(**{"tokenizer.ggml.pre": "no-such-pre"}), "unknown pre-tokenizer tokenizer.ggml.pre='no-such-pre'"),
        (bpe_kv(**{"tokenizer.ggml.pre": "kimi-k2"}), "tokenizer.ggml.pre 'kimi-k2' is not supported"),
        (_drop(bpe_kv(), "tokenizer.ggml.model"), "tokenizer.ggml.model is missing"),
        (_drop(bpe_kv(), "tokenizer.ggml.tokens"), "tokenizer.ggml.tokens is missing"),
        (_drop(bpe_kv(), "tokenizer.ggml.merges"), "needs tokenizer.ggml.merges"),
        (_drop(spm_kv(), "tokenizer.ggml.scores"), "needs tokenizer.ggml.scores"),
        (
            bpe_kv(**{"tokenizer.ggml.token_type": [1] * 10}),
            "token_type has 10 items but tokenizer.ggml.tokens has 261",
        ),
        (spm_kv(**{"tokenizer.ggml.scores": [0.0] * 300}), "scores has 300 items but tokenizer.ggml.tokens has 264"),
        (bpe_kv(**{"tokenizer.ggml.merges": ["Ġ t", "h x"]}), r"merges\[1\] = 'h x' names 'hx', which is not a token"),
        (bpe_kv(**{"tokenizer.ggml.merges": ["Ġ t", "q zz"]}), r"merges\[1\] = 'q zz' names 'zz'"),
        (bpe_kv(**{"tokenizer.ggml.merges": ["Ġt"]}), r"merges\[0\] = 'Ġt' has no space"),
        (bpe_kv(**{"tokenizer.ggml.tokens": [BYTE_CHARS[b] for b in range(256)] + ["a"] * 5}), "holds 'a' twice"),
        (bpe_kv(**{"tokenizer.ggml.bos_token_id": 9999}), "bos_token_id=9999 is not a token id"),
        (bpe_kv(**{"tokenizer.ggml.tokens": list(range(261))}), "tokenizer.ggml.tokens must be an array of STRING"),
        (bpe_kv(**{"tokenizer.ggml.pre": 7}), "tokenizer.ggml.pre must be a string"),
        (bpe_kv(**{"tokenizer.ggml.add_bos_token": 1}), "add_bos_token must be a bool"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_vocabulary_the_tokenizer_does_not_know_is_refused(
    tmp_path: Path, kv: dict[str, object], needle: str
) -> None:
    with pytest.raises(VocabularyError, match=needle) as info:
        _tok(tmp_path, kv)
    assert isinstance(info.value, FormatError) and isinstance(info.value, ValueError)
    assert isinstance(info.value, aioexperts.AioExpertsError)


def test_a_file_that_is_not_gguf_is_a_format_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(FormatError, match="not a GGUF file"):
        Tokenizer.from_gguf(bad)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (b"bytes", "takes a str, not bytes"),
        (None, "takes a str"),
        ("a\ud800b", "not valid Unicode"),
    ],
)
def test_bad_text_is_a_tokenizer_error(tmp_path: Path, text: object, needle: str) -> None:
    tok = _tok(tmp_path, bpe_kv())
    with pytest.raises(TokenizerError, match=needle):
        tok.encode(text)  # type: ignore[arg-type]


def test_an_empty_text_gives_no_ids_or_only_the_special_ones(tmp_path: Path) -> None:
    """As llama.cpp's llama_tokenize (and every tokenizer library): [] or the BOS/EOS add_special adds."""
    bpe = _tok(tmp_path, bpe_kv(), "bpe.gguf")
    assert bpe.encode("") == [] and bpe.encode("", parse_special=True) == []
    both = _tok(
        tmp_path,
        bpe_kv(**{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}),
        "both.gguf",
    )
    assert both.encode("") == [259, 259] and both.encode("", add_special=False) == []
    spm = _tok(tmp_path, spm_kv(), "spm.gguf")  # no space-prefix token for an empty text
    assert spm.encode("") == [1] and spm.encode("", add_special=False) == []
    assert spm.decode(spm.encode("", add_special=False)) == ""


def test_a_bpe_vocabulary_without_a_pre_tokenizer_warns_of_the_fallback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="aioexperts"):
        named = _tok(tmp_path, bpe_kv(), "named.gguf")
    assert not caplog.records and named.pre_type == "GPT2"
    for name, kv in (
        ("missing.gguf", _drop(bpe_kv(), "tokenizer.ggml.pre")),
        ("empty.gguf", bpe_kv(**{"tokenizer.ggml.pre": ""})),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="aioexperts"):
            tok = _tok(tmp_path, kv, name)
        assert tok.pre_type == "DEFAULT"  # still loads, as in llama.cpp
        [record] = caplog.records
        assert record.levelno == logging.WARNING and record.name == "aioexperts"
        assert "no tokenizer.ggml.pre" in record.getMessage() and "'default' pre-tokenizer" in record.getMessage()
        assert name in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aioexperts"):
        _tok(tmp_path, spm_kv(), "spm.gguf")  # SPM has no pre-tokenizer to miss
    assert not caplog.records


@pytest.mark.parametrize("bad", [261, -1, 10**12, "3", 2.0, None])
def test_an_id_outside_the_vocabulary_is_a_tokenizer_error(tmp_path: Path, bad: object) -> None:
    tok = _tok(tmp_path, bpe_kv())
    with pytest.raises(TokenizerError, match="token id"):
        tok.decode([0, bad])  # type: ignore[list-item]
    with pytest.raises(TokenizerError, match="token id"):
        tok.decoder().feed([bad])  # type: ignore[list-item]
    with pytest.raises(TokenizerError, match="token id"):
        tok.token_text(bad)  # type: ignore[arg-type]


def test_an_unknown_special_token_is_plain_text(tmp_path: Path) -> None:
    """A special-looking string the vocabulary does not have is tokenized as text, parsed or not."""
    tok = _tok(tmp_path, bpe_kv())
    text = "<|im_start|>the"
    assert tok.encode(text, parse_special=True) == tok.encode(text, parse_special=False)
    assert tok.decode(tok.encode(text)) == text


def test_spm_character_without_byte_token_is_a_tokenizer_error(tmp_path: Path) -> None:
    kv = spm_kv()
    tokens = list(kv["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    tokens[3 + 0x63] = "<0xZZ>"  # no <0x63> any more: "c" has nowhere to go
    tok = _tok(tmp_path, spm_kv(**{"tokenizer.ggml.tokens": tokens}))
    with pytest.raises(TokenizerError, match="no byte token for 0x63"):
        tok.encode("c")


def test_without_tokenizers_a_bpe_vocabulary_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_vocab(tmp_path / "bpe.gguf", bpe_kv())
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    with pytest.raises(OptionalDependencyError, match=r"pip install 'aioexperts\[text\]'"):
        Tokenizer.from_gguf(path)
    spm = Tokenizer.from_gguf(write_vocab(tmp_path / "spm.gguf", spm_kv()))  # SPM needs no extra
    assert spm.encode("ab") == [1, 259 + 3, 259 + 2]


def test_aioexperts_imports_without_the_text_extra() -> None:
    code = (
        "import sys; sys.modules['tokenizers'] = None; sys.modules['jinja2'] = None\n"
        "import aioexperts; assert aioexperts.Tokenizer.from_gguf; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "ok"


def test_a_tokenizer_is_cached_per_file(tmp_path: Path) -> None:
    path = write_vocab(tmp_path / "bpe.gguf", bpe_kv())
    assert Tokenizer.from_gguf(path) is Tokenizer.from_gguf(str(path))
    write_vocab(path, bpe_kv(**{"tokenizer.ggml.pre": "no-such-pre", "general.name": "changed"}))
    with pytest.raises(VocabularyError, match="no-such-pre"):  # a changed file is read again
        Tokenizer.from_gguf(path)
