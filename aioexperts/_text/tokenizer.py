"""The tokenizer of a GGUF file, built from its ``tokenizer.ggml.*`` keys to give llama.cpp's token ids.

Three vocabulary kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE. The ``tokenizers`` package runs it (a BPE model from ``tokenizer.ggml.tokens``
  and ``tokenizer.ggml.merges``, one ``Split`` pre-tokenizer per regex of llama.cpp's table for
  ``tokenizer.ggml.pre`` (:mod:`.pretokenize`), ``ByteLevel`` without its own regex).
- ``llama``: SentencePiece, llama.cpp's score-driven merge loop with byte fallback (:mod:`.spm`).
- ``gemma4``: SPM-style BPE on raw UTF-8 (``▁`` for spaces, ``<0xXX>`` byte fallback), the merges run
  by ``tokenizers`` on each run of non-newline characters.

Special tokens follow ``llama_vocab::impl::tokenizer_st_partition``: control tokens are split out of the
text only with ``parse_special=True``; user-defined tokens always are (as Hugging Face ``tokenizers``
does with its added tokens). The token attributes (which tokens are control, end-of-generation,
``rstrip`` for Phi-3, ...) follow ``llama_vocab::impl::load``; decoding follows
``llama_vocab::impl::token_to_piece`` and ``detokenize`` (with ``remove_special=false``, as llama.cpp's
``common_detokenize``).
"""

from __future__ import annotations

import codecs
import logging
import operator
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from .._errors import OptionalDependencyError, TokenizerError, VocabularyError
from . import pretokenize
from .spm import spm_tokenize
from .vocab import TokenAttr, TokenType, Vocabulary, read_vocabulary

log = logging.getLogger("aioexperts")

__all__ = ("IncrementalDecoder", "Tokenizer")

# attributes as plain ints: IntFlag arithmetic costs seconds over a 150k-token vocabulary
_UNKNOWN = int(TokenAttr.UNKNOWN)
_UNUSED = int(TokenAttr.UNUSED)
_NORMAL = int(TokenAttr.NORMAL)
_CONTROL = int(TokenAttr.CONTROL)
_USER_DEFINED = int(TokenAttr.USER_DEFINED)
_BYTE = int(TokenAttr.BYTE)
_LSTRIP = int(TokenAttr.LSTRIP)
_RSTRIP = int(TokenAttr.RSTRIP)
_SPECIAL_ATTRS = _CONTROL | _UNKNOWN
_C_SPACE = frozenset(" \t\n\v\f\r")  # C isspace() in the "C" locale
_SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")
_NEWLINE_RUNS = re.compile(r"[^\n]+|\n+")

# token texts llama.cpp's load() recognises (in its order of candidates)
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    )
)

#: the tokenizers built last, by (real path, size, mtime): a 150k-token one holds tens of MB
_CACHE_SIZE = 4
_cache: OrderedDict[tuple[str, int, int], Tokenizer] = OrderedDict()
_cache_lock = threading.Lock()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (llama.cpp's ``unicode_byte_to_utf8_map``)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


class Tokenizer:
    """Text to token ids and back, exactly as llama.cpp does it for the same GGUF file.

    Build one with :meth:`from_gguf`. A tokenizer is immutable and can be shared between threads.

    Attributes:
        path: the GGUF file it was read from.
        model: ``tokenizer.ggml.model`` (``gpt2``, ``llama`` or ``gemma4``).
        pre: ``tokenizer.ggml.pre`` ('' when absent).
        pre_type: llama.cpp's pre-tokenizer type for it (``QWEN2``, ``LLAMA3``, ...; ``DEFAULT`` for SPM).
        bos_id, eos_id, eot_id, eom_id, unk_id, pad_id: special token ids (None when the vocabulary has
            none), after llama.cpp's defaults and its detection by token text.
        eog_ids: every end-of-generation id (llama.cpp's ``special_eog_ids``).
        add_bos, add_eos: whether ``encode(..., add_special=True)`` adds BOS / EOS.
        add_space_prefix: SPM: a space goes before the text and after every special token.
        chat_template: ``tokenizer.chat_template``; None when absent.
    """

    path: str
    model: str
    pre: str
    pre_type: str
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    pad_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def __init__(self, vocab: Vocabulary) -> None:
        """Use :meth:`from_gguf`; this builds from already read keys."""
        self.path = vocab.path
        self.model = vocab.model
        self.pre = "gemma4" if vocab.model == "gemma4" else (vocab.pre or "")  # as llama.cpp's load()
        self.chat_template = vocab.chat_template
        if vocab.model not in _SUPPORTED_MODELS:
            raise VocabularyError(
                f"{vocab.path}: tokenizer.ggml.model {vocab.model!r} is not supported "
                f"(aioexperts tokenizes {', '.join(_SUPPORTED_MODELS)})"
            )
        self._tokens = vocab.tokens
        self._token_to_id = {t: i for i, t in enumerate(vocab.tokens)}
        n = len(vocab.tokens)
        self._is_spm = vocab.model == "llama"
        row: pretokenize.PreTokenizer | None = None
        if self._is_spm:
            self.pre_type = "DEFAULT"
            clean_spaces, add_bos, add_space_prefix = False, True, True
            if vocab.scores is None:
                raise VocabularyError(f"{vocab.path}: an SPM vocabulary needs tokenizer.ggml.scores")
        else:
            if self.pre in pretokenize.UNSUPPORTED_PRE:
                raise VocabularyError(
                    f"{vocab.path}: tokenizer.ggml.pre {self.pre!r} is not supported: "
                    f"{pretokenize.UNSUPPORTED_PRE[self.pre]}"
                )
            if not self.pre:  # llama.cpp loads it too, with a loud warning
                log.warning(
                    "%s: the vocabulary has no tokenizer.ggml.pre: falling back to the 'default' pre-tokenizer, "
                    "which may split text differently from the model's own (generation quality may suffer; "
                    "convert the model again with a current convert_hf_to_gguf.py)",
                    vocab.path,
                )
            row = pretokenize.lookup_pre(self.pre or None)
            if row is None:
                raise VocabularyError(
                    f"{vocab.path}: unknown pre-tokenizer tokenizer.ggml.pre={self.pre!r} "
                    "(not in llama.cpp's table; see docs/text.md for the values aioexperts knows)"
                )
            self.pre_type = row.type
            clean_spaces, add_bos, add_space_prefix = row.clean_spaces, row.add_bos, False
            if vocab.merges is None:
                raise VocabularyError(f"{vocab.path}: a BPE vocabulary needs tokenizer.ggml.merges")
        add_space_prefix = vocab.flags.get("add_space_prefix", add_space_prefix)
        self._clean_spaces = clean_spaces

        attrs = self._initial_attrs(vocab)
        ids = self._special_ids(vocab, n, row)
        self.add_bos = vocab.flags.get("add_bos_token", add_bos)
        if row is not None and row.type == "GEMMA4":
            self.add_bos = True  # llama.cpp overrides the key for Gemma 4
        self._escape_whitespaces = row is not None and not row.byte_encode
        self._gemma_newlines = row is not None and row.type == "GEMMA4"
        self.add_eos = vocab.flags.get("add_eos_token", False)
        self.add_space_prefix = add_space_prefix
        eog = self._detect_by_text(ids, attrs)
        self._attrs = attrs
        self.bos_id, self.eos_id, self.eot_id = ids["bos"], ids["eos"], ids["eot"]
        self.eom_id, self.unk_id, self.pad_id = ids["eom"], ids["unk"], ids["pad"]
        self.eog_ids = frozenset(eog)
        if self.add_bos and self.bos_id is None:
            raise VocabularyError(f"{vocab.path}: the vocabulary adds a BOS token but has no BOS id")
        if self.add_eos and self.eos_id is None:
            raise VocabularyError(f"{vocab.path}: the vocabulary adds an EOS token but has no EOS id")

        # llama.cpp's cache_special_tokens: longest text first (ties: by id, std::sort leaves them open)
        special = [i for i, a in enumerate(attrs) if a & (_CONTROL | _USER_DEFINED | _UNKNOWN)]
        self._set_model_attrs(vocab, special, attrs)
        special.sort(key=lambda i: (-len(self._tokens[i].encode("utf-8")), i))
        self._special = [(self._tokens[i], i, attrs[i]) for i in special]

        if self._is_spm:
            assert vocab.scores is not None
            self._scores = [float(s) for s in vocab.scores]
            self._backend: Any = None
        else:
            assert row is not None and vocab.merges is not None
            self._backend = _build_bpe(vocab, row, self._token_to_id)
        self._pieces: list[bytes | None] = [None] * n

    # --- construction -----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer of the GGUF file at ``path`` (a model or a vocabulary-only file).

        Blocking: reads every token and merge of the file. The last few results are cached per file
        (path, size and modification time), so a second call is free.

        Args:
            path: the GGUF file.

        Returns:
            The tokenizer.

        Raises:
            VocabularyError: an unknown ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre`` (named in the
                message), a missing key, arrays of mismatched lengths, merges that name unknown tokens, a
                special-token id out of range (also a ``FormatError`` and ``ValueError``).
            FormatError: the file is not a readable GGUF.
            OptionalDependencyError: a BPE vocabulary, and the optional ``tokenizers`` package is missing
                (``pip install 'aioexperts[text]'``).
            OSError: the file cannot be read.
        """
        path = os.fspath(path)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        with _cache_lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return hit
        tok = cls(read_vocabulary(path))
        with _cache_lock:
            tok = _cache.setdefault(key, tok)
            _cache.move_to_end(key)
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
        return tok

    @staticmethod
    def _initial_attrs(vocab: Vocabulary) -> list[int]:
        if vocab.types is None:
            return [_NORMAL] * len(vocab.tokens)
        table = {
            TokenType.UNKNOWN: _UNKNOWN,
            TokenType.UNUSED: _UNUSED,
            TokenType.NORMAL: _NORMAL,
            TokenType.CONTROL: _CONTROL,
            TokenType.USER_DEFINED: _USER_DEFINED,
            TokenType.BYTE: _BYTE,
        }
        return [table.get(t, 0) for t in vocab.types]  # type: ignore[call-overload]

    def _special_ids(self, vocab: Vocabulary, n: int, row: pretokenize.PreTokenizer | None) -> dict[str, int | None]:
        # llama.cpp's defaults per model, then the keys
        ids: dict[str, int | None] = dict.fromkeys(
            (
                "bos",
                "eos",
                "eot",
                "eom",
                "unk",
                "sep",
                "pad",
                "mask",
                "fim_pre",
                "fim_suf",
                "fim_mid",
                "fim_pad",
                "fim_rep",
                "fim_sep",
            )
        )
        if self._is_spm:
            ids.update(bos=1, eos=2, unk=0)
        else:
            ids.update(bos=11, eos=11)
            if row is not None and row.no_bos:
                ids["bos"] = None
        for k, v in ids.items():
            if v is not None and v >= n:
                ids[k] = None
        ids.update(vocab.special_ids)
        return ids

    def _detect_by_text(self, ids: dict[str, int | None], attrs: list[int]) -> set[int]:
        """EOT/EOM/FIM detection, unused marking and the EOG set of llama.cpp's load()."""
        t2i = self._token_to_id

        def find(texts: Iterable[str]) -> int | None:
            for text in texts:
                i = t2i.get(text)
                if i is not None:
                    attrs[i] |= _CONTROL
                    return i
            return None

        if ids["eot"] is None:
            ids["eot"] = find(_EOT_TEXTS)
        if ids["eom"] is None:
            ids["eom"] = find(_EOM_TEXTS)
        for key, candidates in _FIM_TEXTS.items():
            if ids[key] is None:
                ids[key] = find(candidates)
        for index, a in enumerate(attrs):
            if a & _CONTROL and "unused" in self._tokens[index]:
                attrs[index] = a | _UNUSED
        eog = {j for k in ("fim_pad", "fim_rep", "fim_sep") if (j := ids[k]) is not None}
        for text in _EOG_TEXTS:
            found = t2i.get(text)
            if found is not None:
                eog.add(found)
                attrs[found] |= _CONTROL
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
            found = t2i.get(text)
            if found is not None:
                attrs[found] = _USER_DEFINED
        eog.update(j for k in ("eos", "eot", "eom") if (j := ids[k]) is not None)
        texts = {self._tokens[j] for j in eog}
        # o200k_harmony and solar-open: "<|end|>" is not an end of generation there
        end = t2i.get("<|end|>")
        if end is not None and end in eog:
            harmony = "<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts)
            solar = "<|calls|>" in texts and "<|flush|>" in texts
            if harmony or solar:
                eog.discard(end)
                attrs[end] = _USER_DEFINED
        # gemma4 and plamo: "</s>" is a normal token
        s_id = t2i.get("</s>")
        if s_id is not None and s_id in eog and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(s_id)
            attrs[s_id] = _NORMAL
        return eog

    def _set_model_attrs(self, vocab: Vocabulary, special: list[int], attrs: list[int]) -> None:
        """llama.cpp's per-model attributes (the end of load()): lstrip/rstrip by model or pre name."""
        t2i = self._token_to_id
        name = vocab.name.lower()
        if any(s in self.pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")):
            if "<mask>" in t2i:
                attrs[t2i["<mask>"]] |= _LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i in special:
                attrs[i] |= _RSTRIP
            if "</s>" in t2i:
                attrs[t2i["</s>"]] |= _RSTRIP
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                if text in t2i:
                    attrs[t2i[text]] &= ~_RSTRIP
        elif "modern-bert" in name and "[MASK]" in t2i:
            attrs[t2i["[MASK]"]] |= _LSTRIP

    # --- queries ------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        """Number of tokens."""
        return len(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The text of a token as the vocabulary stores it (``Ġ`` / ``▁`` and all).

        Raises:
            TokenizerError: ``token_id`` is not in ``range(n_vocab)``.
        """
        return self._tokens[self._check_id(token_id)]

    def token_to_id(self, text: str) -> int | None:
        """The id of the token whose stored text is ``text``, or None."""
        return self._token_to_id.get(text)

    def is_control(self, token_id: int) -> bool:
        """Whether the token is a control (or unknown) token: ``decode`` drops it with ``skip_special``."""
        return bool(self._attrs[self._check_id(token_id)] & _SPECIAL_ATTRS)

    def is_eog(self, token_id: int) -> bool:
        """Whether the token ends generation (EOS, EOT, ``<|im_end|>``, ...: llama.cpp's ``is_eog``)."""
        return token_id in self.eog_ids

    def _check_id(self, token_id: int) -> int:
        if type(token_id) is not int:  # numpy integers pass through operator.index, bools and floats do not
            if isinstance(token_id, bool):
                raise TokenizerError(f"token id {token_id!r} is a bool, not an integer")
            try:
                token_id = operator.index(token_id)
            except TypeError:
                raise TokenizerError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} is not in the vocabulary (0..{len(self._tokens) - 1})")
        return token_id

    # --- encode -------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize(text, add_special, parse_special)``.

        Args:
            text: the text; an empty text gives no ids, or only the BOS / EOS ids ``add_special``
                adds (as llama.cpp's ``llama_tokenize``).
            add_special: add BOS / EOS where the vocabulary says so (``add_bos`` / ``add_eos``). A text that
                already starts with the BOS text gets two BOS ids (as in llama.cpp) when it is also parsed.
            parse_special: split control tokens (``<|im_start|>``, ``<s>``, ...) out of the text and
                give their ids; otherwise their text is tokenized as plain text. User-defined tokens are
                split out either way.

        Returns:
            The ids (each in ``range(n_vocab)``).

        Raises:
            TokenizerError: ``text`` is not a ``str``, or cannot be encoded as UTF-8 (a lone surrogate);
                SPM: a character the vocabulary has neither a token nor a byte token for.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"the text is not valid Unicode (at index {exc.start}: {exc.reason})") from None
        fragments = self._partition(text, parse_special) if text else []  # llama.cpp: no fragment at all
        out: list[int] = []
        if add_special and self.add_bos:
            assert self.bos_id is not None
            out.append(self.bos_id)
        if self._is_spm:
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(spm_tokenize(frag.replace(" ", "▁"), self._token_to_id, self._scores, self._byte_token))
                prev_special = False
        else:
            # one fragment at a time: encode_batch would fan out over every core (rayon)
            encode = self._backend.encode
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                elif self._escape_whitespaces:
                    out.extend(self._encode_raw_utf8(frag.replace(" ", "▁")))
                else:
                    out.extend(encode(frag, add_special_tokens=False).ids)
        if add_special and self.add_eos:
            assert self.eos_id is not None
            out.append(self.eos_id)
        return out

    def _encode_raw_utf8(self, text: str) -> list[int]:
        """SPM-style BPE (gemma4, sarvam-moe): newline runs split off, then BPE on the characters.

        A run of newlines that is itself a token stays one token (gemma4, llama.cpp PR 21343).
        """
        out: list[int] = []
        for match in _NEWLINE_RUNS.finditer(text):
            word = match.group()
            if self._gemma_newlines and word[0] == "\n" and (tok := self._token_to_id.get(word)) is not None:
                out.append(tok)
            else:
                out.extend(self._backend.encode(word, add_special_tokens=False).ids)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: special tokens out of the text, longest first."""
        frags: list[str | int] = [text]
        for tok_text, tok_id, attr in self._special:
            if not parse_special and attr & _SPECIAL_ATTRS:
                continue
            if tok_text not in text:
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok_text not in frag:
                    new.append(frag)
                    continue
                pos = 0
                while True:
                    hit = frag.find(tok_text, pos)
                    if hit < 0:
                        break
                    left_end = hit
                    if attr & _LSTRIP:
                        while left_end > pos and frag[left_end - 1] in _C_SPACE:
                            left_end -= 1
                    if left_end > pos:
                        new.append(frag[pos:left_end])
                    new.append(tok_id)
                    pos = hit + len(tok_text)
                    if attr & _RSTRIP:
                        while pos < len(frag) and frag[pos] in _C_SPACE:
                            pos += 1
                if pos < len(frag):
                    new.append(frag[pos:])
            frags = new
        return frags

    def _byte_token(self, byte: int) -> int:
        """llama.cpp's byte_to_token for SPM: ``<0xXX>``, else the byte as a one-character token."""
        tok = self._token_to_id.get(f"<0x{byte:02X}>")
        if tok is None:
            tok = self._token_to_id.get(chr(byte)) if byte < 0x80 else None
        if tok is None:
            raise TokenizerError(f"{self.path}: the vocabulary has no byte token for 0x{byte:02X} (byte fallback)")
        return tok

    # --- decode -------------------------------------------------------------------------------------

    def piece(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """The bytes one token stands for (llama.cpp's ``token_to_piece``; may be part of a character).

        Args:
            token_id: the token.
            skip_special: give ``b""`` for control and unknown tokens.

        Raises:
            TokenizerError: ``token_id`` is not in the vocabulary.
        """
        token_id = self._check_id(token_id)
        if skip_special and self._attrs[token_id] & _SPECIAL_ATTRS:
            return b""
        cached = self._pieces[token_id]
        if cached is None:
            cached = self._pieces[token_id] = self._make_piece(token_id)
        return cached

    def _make_piece(self, token_id: int) -> bytes:
        attr = self._attrs[token_id]
        text = self._tokens[token_id]
        if attr & (_SPECIAL_ATTRS | _USER_DEFINED):
            return text.encode("utf-8")
        if attr & _NORMAL:
            if self._is_spm or self._escape_whitespaces:
                return text.replace("▁", " ").encode("utf-8")
            out = bytearray()
            for ch in text:
                b = _CHAR_TO_BYTE.get(ch)
                if b is None:  # llama_decode_text's marker for a character outside the byte map
                    utf8 = ch.encode("utf-8")
                    out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8") + b"]"
                else:
                    out.append(b)
            return bytes(out)
        if attr & _BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                raise TokenizerError(f"{self.path}: byte token {token_id} has the text {text!r}, not <0xXX>") from None
        return b""

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of ``ids``, as llama.cpp's ``common_detokenize`` gives it.

        SPM: the first token loses one leading space (the space prefix ``encode`` adds). Vocabularies with
        llama.cpp's ``clean_spaces`` (gpt-2, llama-bpe, ...) drop the space before ``?!.,`` and before
        ``'s``/``'m``/``'re``/``'ve``. Bytes that are not valid UTF-8 become U+FFFD.

        Args:
            ids: token ids.
            skip_special: leave out control and unknown tokens (BOS, ``<|im_end|>``, ...).

        Returns:
            The text.

        Raises:
            TokenizerError: ``ids`` is not an iterable of ids (None, a string), or an id is not in
                the vocabulary.
        """
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise TokenizerError(f"decode() takes an iterable of token ids, got {ids!r:.80}")
        raw = self._raw_bytes(ids, skip_special, first=True)
        text = raw.decode("utf-8", errors="replace")
        return _clean_spaces(text) if self._clean_spaces else text

    def _raw_bytes(self, ids: Iterable[int], skip_special: bool, *, first: bool) -> bytes:
        parts: list[bytes] = []
        for tid in ids:
            p = self.piece(tid, skip_special=skip_special)
            if first:
                first = False
                if self.add_space_prefix and p.startswith(b" "):
                    p = p[1:]
            parts.append(p)
        return b"".join(parts)

    def decoder(self, *, skip_special: bool = False) -> IncrementalDecoder:
        """A decoder for a stream of ids (generation): see :class:`IncrementalDecoder`."""
        return IncrementalDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, model={self.model!r}, pre={self.pre!r}, n_vocab={len(self._tokens)})"


class IncrementalDecoder:
    """Decodes ids one at a time; the concatenated results equal :meth:`Tokenizer.decode` of all ids.

    Never emits part of a UTF-8 character: bytes of an unfinished character wait for the next ids. With
    llama.cpp's ``clean_spaces`` trailing spaces and quotes wait too (the next characters decide
    whether they stay), with the character before them. Call :meth:`flush` at the end of the stream for
    what is still held back.

    Args:
        tokenizer: the tokenizer.
        skip_special: as for :meth:`Tokenizer.decode`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._first = True
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded text not yet emitted (clean_spaces needs a look ahead)

    def feed(self, ids: int | Sequence[int]) -> str:
        """Take one id (or several) and return the text that is now final ('' when none is).

        Raises:
            TokenizerError: an id is not in the vocabulary.
        """
        seq = list(ids) if isinstance(ids, Iterable) else [ids]
        raw = self._tok._raw_bytes(seq, self._skip, first=self._first)
        if seq:
            self._first = False
        text = self._utf8.decode(raw)
        if not self._tok._clean_spaces:
            return text
        start = len(self._pending)
        self._pending += text
        cut = _safe_cut(self._pending, start)  # only the new places: each is looked at once (linear)
        if not cut:
            return ""
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return _clean_spaces(out)

    def flush(self) -> str:
        """The text still held back (an unfinished UTF-8 sequence becomes U+FFFD); the decoder then resets."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        out = self._pending + text
        self._pending = ""
        self._first = True
        return _clean_spaces(out) if self._tok._clean_spaces else out


_TOUCHY = frozenset(" '\0")


def _safe_cut(text: str, start: int = 0) -> int:
    """The last place at or after ``start`` where ``text`` can be cut so that cleaning both halves
    equals cleaning the whole; 0 when there is none.

    The passes of llama.cpp's clean_spaces remove a space before ``?!.,``, the spaces around a lone
    ``'``, and a space before ``'s``, ``'m``, ``'re``, ``'ve`` (after the second pass). A cut before
    ``text[i]`` is safe when ``text[i - 1]`` is an ordinary character, ``text[i]`` is not a quote, and
    the cut does not split ``'re``/``'ve`` (a quote two back, or a quote and a space three back).
    Checked against every string of up to 7 characters of space, quote, ``.srea`` and NUL, and every cut.
    """
    i = len(text) - 1  # the cut goes before text[i], which must exist
    while i >= max(1, start):
        if (
            text[i - 1] not in _TOUCHY
            and text[i] not in "'\0"
            and not (i >= 2 and text[i - 2] == "'")
            and not (i >= 3 and text[i - 2] == " " and text[i - 3] == "'")
        ):
            return i
        i -= 1
    return 0


def _clean_spaces(text: str) -> str:
    """llama.cpp's ``clean_spaces`` passes of ``llama_vocab::impl::detokenize``, on characters."""
    if not text:
        return text
    # pass 1: " ?", " !", " .", " ," lose the space
    t = list(text)
    out = [t[0]]
    for i in range(1, len(t)):
        x = t[i]
        if t[i - 1] == " " and x in "?!.,":
            out.pop()
        out.append(x)
    # pass 2: " ' " becomes "'"
    t = out
    out = [t[0]]
    i = 1
    while i < len(t):
        x = t[i]
        if x == "'" and i + 1 < len(t) and t[i - 1] == " " and t[i + 1] == " ":
            out.pop()
            t[i + 1] = "\0"
            i += 1
        out.append(x)
        i += 1
    # the skipped space was set to NUL in place and never copied
    # pass 3: " 's", " 'm", " 're", " 've" lose the space
    t = out
    out = [t[0]]
    n = len(t)
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == " " and x == "'" and i + 1 < n:
            x1 = t[i + 1]
            if x1 in "sm" or (i + 2 < n and ((x1 == "r" and t[i + 2] == "e") or (x1 == "v" and t[i + 2] == "e"))):
                out.pop()
        out.append(x)
    return "".join(out)


def _build_bpe(vocab: Vocabulary, row: pretokenize.PreTokenizer, token_to_id: dict[str, int]) -> Any:
    """The ``tokenizers`` pipeline for a byte-level BPE vocabulary."""
    try:
        import tokenizers
        from tokenizers import models, pre_tokenizers
    except ImportError:
        raise OptionalDependencyError(
            "the tokenizer of a BPE vocabulary needs the optional 'tokenizers' package: pip install 'aioexperts[text]'"
        ) from None
    assert vocab.merges is not None
    merges = _split_merges(vocab, token_to_id)
    try:
        model = models.BPE(
            vocab=token_to_id,
            merges=merges,
            ignore_merges=row.ignore_merges,
            fuse_unk=False,
            byte_fallback=not row.byte_encode,  # <0xXX> tokens for what no token covers
        )
    except Exception as exc:  # the library's own check of the vocabulary
        raise VocabularyError(f"{vocab.path}: the BPE vocabulary does not build: {exc}") from exc
    tok = tokenizers.Tokenizer(model)
    if not row.byte_encode:  # raw UTF-8: the caller splits off newline runs; no pre-tokenizer
        return tok
    splits = [
        pre_tokenizers.Split(tokenizers.Regex(pretokenize.onig_pattern(r)), behavior="isolated", invert=False)
        for r in row.regexes
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)]
    )
    return tok


def _split_merges(vocab: Vocabulary, token_to_id: dict[str, int]) -> list[tuple[str, str]]:
    """``"left right"`` -> ``(left, right)``, cut at the first space after the first character as llama.cpp does.

    Every part and every result must be a token: ``tokenizers`` would panic (not raise) on a merge whose
    result is not in the vocabulary, and llama.cpp would silently never apply it.
    """
    assert vocab.merges is not None
    cuts = [m.find(" ", 1) for m in vocab.merges]
    if -1 in cuts:
        rank = cuts.index(-1)
        raise VocabularyError(f"{vocab.path}: tokenizer.ggml.merges[{rank}] = {vocab.merges[rank]!r} has no space")
    merges = [(m[:c], m[c + 1 :]) for m, c in zip(vocab.merges, cuts, strict=True)]
    names = {a for a, _ in merges}
    names.update(b for _, b in merges)
    names.update(a + b for a, b in merges)
    if not names.issubset(token_to_id.keys()):
        for rank, (a, b) in enumerate(merges):
            for part in (a, b, a + b):
                if part not in token_to_id:
                    raise VocabularyError(
                        f"{vocab.path}: tokenizer.ggml.merges[{rank}] = {a + ' ' + b!r} names {part!r}, "
                        "which is not a token"
                    )
    return merges
