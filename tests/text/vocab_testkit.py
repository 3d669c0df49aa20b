"""Helpers for the tokenizer tests: where llama.cpp's vocabulary goldens are, and tiny synthetic vocabularies."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path

import pytest
from gguf import GGUFValueType, GGUFWriter

from aioexperts import Tokenizer

REPO = Path(__file__).resolve().parents[2]

#: GPT-2's byte -> character table (the alphabet of a byte-level BPE vocabulary)
_KEEP = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
BYTE_CHARS = {b: chr(b) for b in _KEEP}
for _n, _b in enumerate(b for b in range(256) if b not in BYTE_CHARS):
    BYTE_CHARS[_b] = chr(256 + _n)


def vocab_dir() -> Path | None:
    """``$AIOEXPERTS_VOCAB``, else the first ``shared/vocab`` beside or above the checkout."""
    env = os.environ.get("AIOEXPERTS_VOCAB")
    candidates = [Path(env)] if env else []
    candidates += [REPO.parent / "shared" / "vocab", REPO.parent.parent / "shared" / "vocab"]
    for cand in candidates:
        if cand.is_dir() and any(cand.glob("*.gguf")):
            return cand
    if os.environ.get("AIOEXPERTS_REQUIRE_FIXTURES") == "1":
        raise RuntimeError(f"the tokenizer goldens are required but no *.gguf is in {candidates}")
    return None


def golden_vocab_files() -> list[Path]:
    """Every vocabulary with llama.cpp's ``.inp``/``.out`` cases: the shared folder, plus the folders in
    ``$AIOEXPERTS_EXTRA_VOCAB`` (``os.pathsep``-separated, e.g. llama.cpp's ``models/``)."""
    dirs = [d] if (d := vocab_dir()) is not None else []
    dirs += [Path(p) for p in os.environ.get("AIOEXPERTS_EXTRA_VOCAB", "").split(os.pathsep) if p]
    return sorted(p for d in dirs for p in d.glob("*.gguf") if p.with_name(p.name + ".inp").exists())


def vocab_params() -> list[object]:
    files = golden_vocab_files()
    if not files:
        return [pytest.param(None, marks=pytest.mark.skip(reason="no tokenizer goldens (../shared/vocab)"))]
    return [pytest.param(p, id=p.name.removeprefix("ggml-vocab-").removesuffix(".gguf")) for p in files]


def read_cases(path: Path) -> list[tuple[str, list[int]]]:
    """The (text, llama.cpp ids) cases of ``<vocab>.gguf.inp`` / ``.out`` (format: the folder's README)."""
    raw = path.with_name(path.name + ".inp").read_bytes().decode("utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    lines = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts), path
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=False)]


def write_vocab(path: Path, kv: Mapping[str, object], *, arch: str = "llama") -> Path:
    """A vocabulary-only GGUF with the given keys (arrays as lists; types inferred by gguf-py)."""
    writer = GGUFWriter(os.fspath(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            writer.add_key_value(key, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, GGUFValueType.UINT32)
        elif isinstance(value, str):
            writer.add_key_value(key, value, GGUFValueType.STRING)
        else:
            writer.add_key_value(key, list(value), GGUFValueType.ARRAY)  # type: ignore[call-overload]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def bpe_kv(**overrides: object) -> dict[str, object]:
    """A tiny byte-level BPE vocabulary: the 256 byte characters, ``Ġt``, ``he``, ``Ġthe``, a control token
    ``<|endoftext|>`` and a user-defined token ``<tool>``."""
    tokens = [BYTE_CHARS[b] for b in range(256)] + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<tool>"]
    types = [1] * 259 + [3, 4]
    kv: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.bos_token_id": 259,
        "tokenizer.ggml.eos_token_id": 259,
    }
    kv.update(overrides)
    return kv


def spm_kv(**overrides: object) -> dict[str, object]:
    """A tiny SentencePiece vocabulary: ``<unk>``, ``<s>``, ``</s>``, 256 byte tokens, then ``▁ a b ▁a ab``."""
    pieces = ["▁", "a", "b", "▁a", "ab"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-1.0, -2.0, -2.0, -0.5, -3.0]
    kv: dict[str, object] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    kv.update(overrides)
    return kv


@functools.cache
def tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a golden vocabulary, built once per test session (the library keeps only a few)."""
    return Tokenizer.from_gguf(path)
