"""Structured output: a grammar the generated tokens must follow, enforced by masking the logits.

The grammar engine is llguidance (the ``structured`` extra: ``pip install 'aioexperts[structured]'``),
picked over outlines-core and xgrammar by its per-token mask cost and compile time at this project's
vocabulary sizes (bench/structured_mask.py, docs/results/structured-mask.md). A
:class:`TokenConstraint` is built from a JSON schema, "any JSON object", a GBNF grammar (llama.cpp's
``grammar`` field, converted to Lark by llguidance) or a Lark grammar; before each token
:meth:`TokenConstraint.choose` sets the logits of the tokens the grammar forbids to ``-inf``, lets
the sampler pick, and, should the sampler still return a forbidden token, takes the most likely
allowed one instead. Once the grammar is complete only end-of-generation tokens are allowed, so the
generation ends there.

The vocabulary is handed to llguidance as llama.cpp's binding does (llguidance/llamacpp.py): each
token's bytes (``Tokenizer.piece``), control tokens prefixed with ``0xff`` so that no text matches
them; it is built once per tokenizer (about a second at 150k tokens).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import InvalidRequestError, OptionalDependencyError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

__all__ = ("STRUCTURED_EXTRA", "TokenConstraint")

STRUCTURED_EXTRA = "structured"
"""The extra that installs the grammar engine (llguidance)."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise OptionalDependencyError(
            f"structured output needs llguidance: pip install 'aioexperts[{STRUCTURED_EXTRA}]'"
        ) from None
    return llguidance


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> Any:
    """llguidance's view of ``tokenizer`` padded to ``n_vocab`` ids (cached: it is costly to build)."""
    ll = _llguidance()
    eog = sorted(i for i in tokenizer.eog_ids if i < n_vocab)
    if not eog:
        raise InvalidRequestError("the vocabulary has no end-of-generation token: a constrained generation cannot end")
    tokens: list[bytes] = []
    for i in range(min(tokenizer.n_vocab, n_vocab)):
        piece = tokenizer.piece(i)
        tokens.append(b"\xff" + piece if tokenizer.is_control(i) else piece)
    tokens += [b""] * (n_vocab - len(tokens))

    class _Vocab:  # what llguidance.TokenizerWrapper reads
        eos_token_id = eog[0]
        bos_token_id = tokenizer.bos_id
        special_token_ids = [i for i in range(len(tokens)) if tokenizer.is_control(i)] if tokens else []

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str | bytes) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", "replace")
            return tokenizer.encode(text, add_special=False, parse_special=False)

    return ll.LLTokenizer(ll.TokenizerWrapper(_Vocab()), n_vocab=n_vocab, eos_token=eog)


_HEX = frozenset("0123456789abcdefABCDEF")


def _plain_unicode_escapes(source: str) -> str:
    """GBNF's ``\\uXXXX`` and ``\\UXXXXXXXX`` escapes (llama.cpp ``parse_char``) in the forms
    llguidance's converter reads right: ``\\xHH`` below U+0080, the character itself above
    (never special in GBNF). Its own reading drops leading zeros (``\\u00e9`` becomes ``\\ue9``,
    a lexer error) and does not know ``\\U``. Other escapes, ``\\\\`` included, stay as written;
    a surrogate or a code point past U+10FFFF stays escaped (the converter refuses it)."""
    out: list[str] = []
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if c != "\\" or i + 1 >= n:
            out.append(c)
            i += 1
            continue
        kind = source[i + 1]
        width = 4 if kind == "u" else 8 if kind == "U" else 0
        digits = source[i + 2 : i + 2 + width]
        if width and len(digits) == width and set(digits) <= _HEX:
            cp = int(digits, 16)
            if cp < 0x80:
                out.append(f"\\x{cp:02x}")
                i += 2 + width
                continue
            if cp <= 0x10FFFF and not 0xD800 <= cp <= 0xDFFF:
                out.append(chr(cp))
                i += 2 + width
                continue
        out.append(source[i : i + 2])  # this escape (or an escaped backslash) as it is
        i += 2
    return "".join(out)


class TokenConstraint:
    """One generation's grammar state: which tokens may come next, advanced by each chosen token.

    Build it with :meth:`json_schema`, :meth:`json_object`, :meth:`gbnf` or :meth:`lark`; one per
    generation (it holds the parse state). Use :meth:`sampler` to wrap a sampler for
    ``model.stream(..., sampler=...)``, or :meth:`choose` inside your own.

    Args:
        tokenizer: the model's tokenizer.
        grammar: an llguidance grammar (what ``llguidance.LLMatcher.grammar_from_*`` give).
        n_vocab: the logits' size (default the tokenizer's).

    Raises:
        InvalidRequestError: the grammar cannot be compiled, or fails or allows no token at its
            start (the message says why).
        OptionalDependencyError: llguidance (the ``structured`` extra) is not installed.
    """

    def __init__(self, tokenizer: Tokenizer, grammar: str, n_vocab: int | None = None) -> None:
        ll = _llguidance()
        self.n_vocab = tokenizer.n_vocab if n_vocab is None else n_vocab
        self._tokenizer = _ll_tokenizer(tokenizer, self.n_vocab)
        error = ll.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise InvalidRequestError(f"the grammar cannot be compiled: {error}")
        self._matcher = ll.LLMatcher(self._tokenizer, grammar, log_level=0)
        self._check()
        self._words = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        # the first mask now: a grammar that fails at its first token is refused here, before the
        # generation starts (a server answers 400 instead of a failed stream)
        self._first: np.ndarray | None = self._mask()
        if not self._first.any():
            raise InvalidRequestError("the grammar allows no token of this vocabulary at its start")

    @classmethod
    def json_schema(
        cls, tokenizer: Tokenizer, schema: Mapping[str, Any], n_vocab: int | None = None
    ) -> TokenConstraint:
        """JSON valid for ``schema`` (JSON Schema as llguidance supports it; compact, no free whitespace)."""
        ll = _llguidance()
        try:
            grammar = ll.LLMatcher.grammar_from_json_schema(
                json.dumps(schema, allow_nan=False), {"whitespace_flexible": False}
            )
        except (ValueError, TypeError, RuntimeError, RecursionError) as exc:
            raise InvalidRequestError(f"the JSON schema cannot be compiled: {exc}") from None
        return cls(tokenizer, grammar, n_vocab)

    @classmethod
    def json_object(cls, tokenizer: Tokenizer, n_vocab: int | None = None) -> TokenConstraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema(tokenizer, {"type": "object"}, n_vocab)

    @classmethod
    def gbnf(cls, tokenizer: Tokenizer, source: str, n_vocab: int | None = None) -> TokenConstraint:
        """A llama.cpp GBNF grammar (``root ::= ...``), converted to Lark by llguidance."""
        _llguidance()
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(_plain_unicode_escapes(source))
        except Exception as exc:  # noqa: BLE001 (the converter raises plain Exception / AssertionError)
            raise InvalidRequestError(f"the GBNF grammar cannot be read: {exc}") from None
        return cls.lark(tokenizer, lark, n_vocab)

    @classmethod
    def lark(cls, tokenizer: Tokenizer, source: str, n_vocab: int | None = None) -> TokenConstraint:
        """A Lark grammar in llguidance's dialect (``start: ...``)."""
        ll = _llguidance()
        try:
            grammar = ll.LLMatcher.grammar_from_lark(source)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise InvalidRequestError(f"the Lark grammar cannot be compiled: {exc}") from None
        return cls(tokenizer, grammar, n_vocab)

    def _check(self) -> None:
        if self._matcher.is_error():
            # llguidance's message is one line of cause, then a dump of its parser state
            cause = str(self._matcher.get_error()).strip().split("\n", 1)[0][:300]
            raise InvalidRequestError(f"the grammar failed: {cause}")

    @property
    def done(self) -> bool:
        """True once the grammar is complete (only end-of-generation tokens are allowed then)."""
        return bool(self._matcher.is_stopped() or self._matcher.is_accepting())

    def allowed(self) -> np.ndarray:
        """bool ``(n_vocab,)``: the tokens the grammar allows next.

        Raises:
            InvalidRequestError: the grammar is in an error state.
        """
        first, self._first = self._first, None
        return first if first is not None else self._mask()

    def _mask(self) -> np.ndarray:
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self._check()
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
        return bits[: self.n_vocab].astype(bool)

    def choose(self, logits: np.ndarray, pick: Callable[[np.ndarray], int]) -> int:
        """The next token: ``pick`` sees ``logits`` (float ``(n_vocab,)``, not modified) with the
        forbidden tokens at ``-inf``; a forbidden pick is replaced by the most likely allowed token.
        The grammar then advances by the token.

        Raises:
            InvalidRequestError: no token is allowed, or the grammar failed.
        """
        allowed = self.allowed()
        n = min(len(logits), self.n_vocab)
        if not allowed[:n].any():
            raise InvalidRequestError("the grammar allows no token of this vocabulary here")
        masked = np.full(len(logits), -np.inf, dtype=np.float32)
        masked[:n] = np.where(allowed[:n], logits[:n], -np.inf)
        token = pick(masked)
        if isinstance(token, np.integer):
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < n or not allowed[token]:
            finite = np.where(allowed[:n], np.nan_to_num(logits[:n], nan=-np.inf, neginf=-3e38), -np.inf)
            token = int(np.argmax(finite))
        self._matcher.consume_token(token)
        self._check()
        return token

    def sampler(self, inner: Callable[[np.ndarray, Any], int]) -> Callable[[np.ndarray, Any], int]:
        """``(logits, history) -> id`` that constrains ``inner`` (e.g. an :class:`aioexperts.Sampler`)."""

        def constrained(logits: np.ndarray, history: Any) -> int:
            return self.choose(logits, lambda masked: inner(masked, history))

        return constrained
