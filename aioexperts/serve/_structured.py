"""Structured output of a request: ``response_format`` (OpenAI) and ``grammar`` (llama.cpp's GBNF).

- ``{"type": "text"}``: free text (as without the field).
- ``{"type": "json_object"}``: any JSON object; with llama.cpp's ``"schema"`` beside the type, JSON
  valid for that schema.
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON
  valid for the schema (``strict`` is accepted; the schema is always enforced).
- ``"grammar": "root ::= ..."``: a GBNF grammar, as llama.cpp's server takes it (not with
  ``response_format`` JSON).

The grammar is compiled (:class:`aioexperts.TokenConstraint`, the ``structured`` extra) before the
request waits for a slot: a schema or grammar that cannot be compiled is a 400 naming the field,
and so is a structured request to a server without the extra (the message names it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioexperts import InvalidRequestError, OptionalDependencyError, TokenConstraint

from ._errors import APIError

if TYPE_CHECKING:
    from aioexperts import Tokenizer

__all__ = ("StructuredOutput", "compile_structured", "parse_structured")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must be.

    Attributes:
        kind: ``"json_schema"``, ``"json_object"`` or ``"gbnf"``.
        schema: the JSON schema (``json_schema``; ``json_object`` with a schema), else None.
        grammar: the GBNF source (``gbnf``), else None.
        param: the request field it came from (errors name it).
    """

    kind: str
    schema: Mapping[str, Any] | None = None
    grammar: str | None = None
    param: str = "response_format"


def _bad(field: str, message: str) -> APIError:
    param = field.split(".")[0]
    return APIError(400, f"'{field}': {message}", param=param, code="invalid_value")


def parse_structured(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The structured output a request body asks for (``response_format``, ``grammar``), None for text.

    Raises:
        APIError: 400 naming the malformed field.
    """
    fmt = body.get("response_format")
    grammar = body.get("grammar")
    out: StructuredOutput | None = None
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise _bad("response_format", "must be an object")
        kind = fmt.get("type")
        if kind == "json_object":
            schema = fmt.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise _bad("response_format.schema", "must be a JSON schema object")
            out = StructuredOutput("json_schema" if schema else "json_object", schema)
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise _bad("response_format.json_schema", 'must be an object with a "schema" object')
            out = StructuredOutput("json_schema", spec.get("schema") or {})
        elif kind != "text":
            raise _bad("response_format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}')
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise _bad("grammar", "must be a non-empty GBNF grammar string")
        if out is not None:
            raise _bad("grammar", "give either a grammar or a JSON response_format, not both")
        out = StructuredOutput("gbnf", grammar=grammar, param="grammar")
    return out


def compile_structured(spec: StructuredOutput, tokenizer: Tokenizer, n_vocab: int) -> TokenConstraint:
    """The constraint of ``spec`` for one generation (call off the event loop: compiling may take a while).

    Raises:
        APIError: 400, the schema or grammar cannot be compiled, or the ``structured`` extra is missing.
    """
    try:
        if spec.kind == "gbnf":
            assert spec.grammar is not None
            return TokenConstraint.gbnf(tokenizer, spec.grammar, n_vocab)
        if spec.kind == "json_object":
            return TokenConstraint.json_object(tokenizer, n_vocab)
        return TokenConstraint.json_schema(tokenizer, spec.schema or {}, n_vocab)
    except OptionalDependencyError as exc:
        raise APIError(
            400,
            f"'{spec.param}': structured output is not installed on this server: {exc}",
            param=spec.param,
            code="unsupported_feature",
        ) from None
    except InvalidRequestError as exc:
        raise APIError(400, f"'{spec.param}': {exc}", param=spec.param, code="invalid_schema") from None
