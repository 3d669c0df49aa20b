"""TokenConstraint (structured output over llguidance): a sampler that tries forbidden tokens still
yields text the grammar accepts; a grammar that cannot be compiled, or the extra missing, is a clear error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")
jsonschema = pytest.importorskip("jsonschema")

import aioexperts  # noqa: E402
from aioexperts import InvalidRequestError, OptionalDependencyError, TokenConstraint  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "ok", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_full_model: Path) -> aioexperts.Tokenizer:
    return aioexperts.Tokenizer.from_gguf(tiny_full_model)


def _run(constraint: TokenConstraint, tok: aioexperts.Tokenizer, pick_of: object, steps: int = 300) -> str:
    rng = np.random.default_rng(7)
    out: list[int] = []
    for step in range(steps):
        logits = rng.standard_normal(tok.n_vocab).astype(np.float32)
        token = constraint.choose(logits, lambda masked, s=step, raw=logits: pick_of(masked, raw, s))  # type: ignore[operator]
        if token in tok.eog_ids:
            return tok.decode(out)
        out.append(token)
    raise AssertionError(f"no end of generation after {steps} tokens: {tok.decode(out)!r}")


def test_a_sampler_that_tries_forbidden_tokens_still_gives_json_valid_for_the_schema(
    tokenizer: aioexperts.Tokenizer,
) -> None:
    forbidden_tried = 0

    def adversary(masked: np.ndarray, logits: np.ndarray, step: int) -> int:
        nonlocal forbidden_tried
        # the most likely token the grammar forbids, else (every other step) an id out of range
        bad = np.flatnonzero(np.isneginf(masked))
        if step % 2 == 1 or not bad.size:
            forbidden_tried += 1
            return tokenizer.n_vocab + 5
        forbidden_tried += 1
        return int(bad[np.argmax(logits[bad])])

    text = _run(TokenConstraint.json_schema(tokenizer, SCHEMA), tokenizer, adversary)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert forbidden_tried > 5


def test_a_sampler_drawing_from_the_masked_logits_gives_valid_json(tokenizer: aioexperts.Tokenizer) -> None:
    sampler = aioexperts.Sampler(aioexperts.SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    text = _run(TokenConstraint.json_schema(tokenizer, SCHEMA), tokenizer, lambda m, _l, _s: sampler(m, ()))
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_a_gbnf_grammar(tokenizer: aioexperts.Tokenizer) -> None:
    closing = [tokenizer.token_to_id(c) for c in ('"', "}")]
    preferred = [*sorted(tokenizer.eog_ids), *(t for t in closing if t is not None)]

    def pick(masked: np.ndarray, _logits: np.ndarray, step: int) -> int:
        allowed = [t for t in preferred if np.isfinite(masked[t])]
        return allowed[0] if allowed and step > 3 else int(np.argmax(masked))  # a few tokens, then close

    assert isinstance(json.loads(_run(TokenConstraint.json_object(tokenizer), tokenizer, pick)), dict)
    grammar = 'root ::= "yes" | "no"'
    assert _run(TokenConstraint.gbnf(tokenizer, grammar), tokenizer, pick) in ("yes", "no")


@pytest.mark.parametrize(
    ("grammar", "want"),
    [
        (r'root ::= "caf\u00e9"', "café"),
        (r'root ::= "\U0001F600 \u4e2d"', "😀 中"),
        (r'root ::= "\u0022\u0041"', '"A'),
        (r'root ::= "\\u00e9"', "\\u00e9"),  # an escaped backslash, then plain text
    ],
    ids=["latin-1", "astral-and-cjk", "ascii", "escaped-backslash"],
)
def test_gbnf_unicode_escapes_mean_what_llama_cpp_reads(
    tokenizer: aioexperts.Tokenizer, grammar: str, want: str
) -> None:
    def pick(masked: np.ndarray, _logits: np.ndarray, _step: int) -> int:
        return int(np.argmax(masked))

    assert _run(TokenConstraint.gbnf(tokenizer, grammar), tokenizer, pick) == want


def test_a_gbnf_character_range_by_escapes(tokenizer: aioexperts.Tokenizer) -> None:
    def pick(masked: np.ndarray, _logits: np.ndarray, _step: int) -> int:
        return int(np.argmax(masked))

    text = _run(TokenConstraint.gbnf(tokenizer, r"root ::= [\u00e0-\u00ff] [\u00e0-\u00ff]"), tokenizer, pick)
    assert len(text) == 2 and all("\u00e0" <= c <= "\u00ff" for c in text), text


@pytest.mark.parametrize(
    "schema",
    [{"type": "frobnicate"}, {"$ref": "#/definitions/missing"}, {"type": "string", "pattern": "(["}],
    ids=["unknown-type", "dangling-ref", "bad-pattern"],
)
def test_a_schema_that_cannot_be_compiled_is_refused(
    tokenizer: aioexperts.Tokenizer, schema: dict[str, object]
) -> None:
    with pytest.raises(InvalidRequestError, match="cannot be compiled"):
        TokenConstraint.json_schema(tokenizer, schema)


def test_a_bad_gbnf_grammar_is_refused(tokenizer: aioexperts.Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="GBNF|grammar"):
        TokenConstraint.gbnf(tokenizer, "root ::= undefined_rule")


def test_without_llguidance_the_error_names_the_extra(
    tokenizer: aioexperts.Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(OptionalDependencyError, match=r"aioexperts\[structured\]"):
        TokenConstraint.json_object(tokenizer)
