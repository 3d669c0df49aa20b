"""The ``tokenizer.ggml.*`` keys of a GGUF file, read and checked: tokens, scores, types, merges, flags.

The keys are read with the bounded header reader (:func:`aioexperts._format.header.read_header`); large
arrays it leaves in the file (:class:`~aioexperts._format.header.SkippedValue`) are read here with one
``pread`` of the byte range the header reader already checked against the file size. The rules follow
llama.cpp's ``llama_vocab::impl::load`` (``src/llama-vocab.cpp``); where this reader is stricter it says
so (llama.cpp tolerates arrays longer than the token list and bad special-token ids, with a warning).
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType

from .._errors import VocabularyError
from .._format.header import GGUFHeader, SkippedValue, read_header
from .._format.keys import refuse_a_sidecar

__all__ = ("TokenAttr", "TokenType", "Vocabulary", "read_vocabulary")

_U64 = struct.Struct("<Q")


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(enum.IntFlag):
    """Per-token attributes (llama.cpp's ``llama_token_attr``, derived from the token type and the model)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8


_TYPE_TO_ATTR = {
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.BYTE: TokenAttr.BYTE,
}

#: special-token id keys, llama.cpp's ``LLM_KV_TOKENIZER_*_ID``
SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic, as gguf-py spells it
    "pad": "tokenizer.ggml.padding_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
    "fim_pre": "tokenizer.ggml.fim_pre_token_id",
    "fim_suf": "tokenizer.ggml.fim_suf_token_id",
    "fim_mid": "tokenizer.ggml.fim_mid_token_id",
    "fim_pad": "tokenizer.ggml.fim_pad_token_id",
    "fim_rep": "tokenizer.ggml.fim_rep_token_id",
    "fim_sep": "tokenizer.ggml.fim_sep_token_id",
}


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The checked vocabulary keys of one GGUF file (nothing derived yet).

    Attributes:
        path: the file.
        model: ``tokenizer.ggml.model`` (``gpt2``, ``llama``, ...).
        pre: ``tokenizer.ggml.pre``; None when absent.
        tokens: the token texts, by id.
        scores: ``tokenizer.ggml.scores`` as float32 by id; None when absent.
        types: ``tokenizer.ggml.token_type`` by id (ints); None when absent.
        merges: ``tokenizer.ggml.merges`` (``"left right"`` strings) in rank order; None when absent.
        special_ids: the ``tokenizer.ggml.*_token_id`` keys present, short name -> id.
        flags: the boolean keys present (``add_bos_token``, ``add_eos_token``, ``add_space_prefix``, ...),
            without the ``tokenizer.ggml.`` prefix.
        name: ``general.name`` ('' when absent).
        chat_template: ``tokenizer.chat_template``; None when absent.
    """

    path: str
    model: str
    pre: str | None
    tokens: list[str]
    scores: np.ndarray | None
    types: list[int] | None
    merges: list[str] | None
    special_ids: dict[str, int]
    flags: dict[str, bool]
    name: str
    chat_template: str | None


def read_vocabulary(path: str | os.PathLike[str]) -> Vocabulary:
    """Read and check the ``tokenizer.ggml.*`` keys of the GGUF file at ``path``.

    Blocking: reads the header and the token arrays (a few MB for a 150k-token vocabulary).

    Args:
        path: a GGUF file (a full model or a vocabulary-only file).

    Returns:
        The vocabulary keys.

    Raises:
        FormatError: the file is not a readable GGUF (from the header reader), or is a miss-tier
            sidecar (``is a miss-tier sidecar of MODEL, not a model: pass the model``).
        VocabularyError: ``tokenizer.ggml.model`` or ``tokenizer.ggml.tokens`` is missing; a key has the
            wrong type; ``scores`` or ``token_type`` is not as long as ``tokens``; a token is not UTF-8 or
            appears twice; a special-token id is out of range.
        OSError: the file cannot be read.
    """
    path = os.fspath(path)
    header = read_header(path)
    md = header.metadata
    if "tokenizer.ggml.model" not in md:  # a sidecar given for its model: say so, not "no tokenizer"
        refuse_a_sidecar(path, md.get("general.architecture"), md)

    model = _string_key(path, header, "tokenizer.ggml.model", required=True)
    assert model is not None
    pre = _string_key(path, header, "tokenizer.ggml.pre", required=False)
    tokens_raw = _array_key(path, header, "tokenizer.ggml.tokens", (GGUFValueType.STRING,), required=True)
    assert tokens_raw is not None
    tokens = _token_texts(path, tokens_raw)
    n = len(tokens)
    if n == 0:
        raise VocabularyError(f"{path}: tokenizer.ggml.tokens is empty")
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not t:  # llama.cpp names an empty token this way
            tokens[i] = t = f"[EMPTY_{i}]"
        j = seen.setdefault(t, i)
        if j != i:
            raise VocabularyError(
                f"{path}: tokenizer.ggml.tokens holds {t!r} twice (ids {j} and {i}); "
                "llama.cpp refuses such a vocabulary"
            )

    scores_raw = _array_key(
        path, header, "tokenizer.ggml.scores", (GGUFValueType.FLOAT32, GGUFValueType.INT32), required=False
    )
    scores = None if scores_raw is None else np.asarray(scores_raw, dtype=np.float32)
    types_raw = _array_key(path, header, "tokenizer.ggml.token_type", (GGUFValueType.INT32,), required=False)
    types = None if types_raw is None else [int(t) for t in types_raw]
    for key, arr in (("tokenizer.ggml.scores", scores), ("tokenizer.ggml.token_type", types)):
        if arr is not None and len(arr) != n:
            raise VocabularyError(f"{path}: {key} has {len(arr)} items but tokenizer.ggml.tokens has {n}")
    merges_raw = _array_key(path, header, "tokenizer.ggml.merges", (GGUFValueType.STRING,), required=False)
    merges = None if merges_raw is None else _token_texts(path, merges_raw, what="tokenizer.ggml.merges")

    special_ids: dict[str, int] = {}
    for short, key in SPECIAL_ID_KEYS.items():
        if key not in md:
            continue
        value = md[key]
        if not isinstance(value, int) or isinstance(value, bool):
            raise VocabularyError(f"{path}: {key} must be an integer, the file has {value!r}")
        if not 0 <= value < n:
            raise VocabularyError(f"{path}: {key}={value} is not a token id (the vocabulary has {n} tokens)")
        special_ids[short] = value

    flags: dict[str, bool] = {}
    for short in ("add_bos_token", "add_eos_token", "add_sep_token", "add_space_prefix", "remove_extra_whitespaces"):
        key = f"tokenizer.ggml.{short}"
        if key in md:
            if header.value_types[key] != GGUFValueType.BOOL:
                raise VocabularyError(f"{path}: {key} must be a bool, the file has {md[key]!r}")
            flags[short] = bool(md[key])

    name = md.get("general.name", "")
    template = md.get("tokenizer.chat_template")
    return Vocabulary(
        path=path,
        model=model,
        pre=pre,
        tokens=tokens,
        scores=scores,
        types=types,
        merges=merges,
        special_ids=special_ids,
        flags=flags,
        name=name if isinstance(name, str) else "",
        chat_template=template if isinstance(template, str) else None,
    )


def _string_key(path: str, header: GGUFHeader, key: str, *, required: bool) -> str | None:
    if key not in header.metadata:
        if required:
            raise VocabularyError(f"{path}: the key {key} is missing: the file carries no tokenizer")
        return None
    value = header.metadata[key]
    if header.value_types[key] != GGUFValueType.STRING or not isinstance(value, str):
        raise VocabularyError(f"{path}: {key} must be a string, the file has {value!r}")
    return str(value)


def _array_key(
    path: str, header: GGUFHeader, key: str, item_types: tuple[GGUFValueType, ...], *, required: bool
) -> list[Any] | np.ndarray | None:
    """The items of an array key: a list (small arrays, decoded by the header reader) or read from the file."""
    if key not in header.metadata:
        if required:
            raise VocabularyError(f"{path}: the key {key} is missing: the file carries no tokenizer")
        return None
    value = header.metadata[key]
    if header.value_types[key] != GGUFValueType.ARRAY:
        raise VocabularyError(f"{path}: {key} must be an array, the file has a {header.value_types[key].name}")
    if isinstance(value, SkippedValue):
        if value.item_type not in item_types:
            raise VocabularyError(f"{path}: {key} must be an array of {_names(item_types)}, not {value.item_type}")
        return _read_skipped(path, value)
    assert isinstance(value, list)
    if value and isinstance(value[0], list):
        raise VocabularyError(f"{path}: {key} must be an array of {_names(item_types)}, not an array of arrays")
    # a small array arrives decoded; its Python types tell strings, integers and floats apart
    allowed: tuple[type, ...] = ()
    if GGUFValueType.STRING in item_types:
        allowed += (str,)
    if GGUFValueType.INT32 in item_types:
        allowed += (int,)
    if GGUFValueType.FLOAT32 in item_types:
        allowed += (float,)
    if any(isinstance(v, bool) or not isinstance(v, allowed) for v in value):
        raise VocabularyError(f"{path}: {key} must be an array of {_names(item_types)}")
    return value


def _names(types: tuple[GGUFValueType, ...]) -> str:
    return " or ".join(t.name for t in types)


def _read_skipped(path: str, value: SkippedValue) -> list[bytes] | np.ndarray:
    """Read an array the header reader left in the file (its byte range is already checked)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, value.n_bytes, value.offset)
    finally:
        os.close(fd)
    if len(data) != value.n_bytes:
        raise VocabularyError(f"{path}: {value.key} is cut short (the file shrank while it was read)")
    if value.item_type == GGUFValueType.STRING:
        out: list[bytes] = []
        pos = 0
        unpack = _U64.unpack_from
        for _ in range(value.length):
            (length,) = unpack(data, pos)
            pos += 8
            out.append(data[pos : pos + length])
            pos += length
        if pos != len(data):
            raise VocabularyError(f"{path}: {value.key} changed while it was read")
        return out
    dtype = {GGUFValueType.FLOAT32: "<f4", GGUFValueType.INT32: "<i4"}[value.item_type]  # type: ignore[index]
    return np.frombuffer(data, dtype=dtype, count=value.length)


def _token_texts(path: str, raw: list[Any] | np.ndarray, what: str = "tokenizer.ggml.tokens") -> list[str]:
    out: list[str] = []
    for i, item in enumerate(raw):
        if isinstance(item, bytes):
            try:
                out.append(item.decode("utf-8"))
            except UnicodeDecodeError:
                raise VocabularyError(f"{path}: {what}[{i}] is not valid UTF-8 ({item[:40]!r})") from None
        else:
            if hasattr(item, "raw"):  # a LossyStr from the header reader
                raise VocabularyError(f"{path}: {what}[{i}] is not valid UTF-8 ({item.raw[:40]!r})")
            out.append(str(item))
    return out
