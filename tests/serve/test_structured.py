"""Structured output through the server: ``response_format`` (json_object, json_schema) and
``grammar`` (GBNF) constrain the sampler; a schema that cannot be compiled, or a server without the
``structured`` extra, is a 400 naming the field."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from serve.serving import ServerThread, post, request  # noqa: E402

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
USER = [{"role": "user", "content": "Describe a pet as JSON"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "legs", "kind"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


def _content(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_is_valid_for_the_schema(served: ServerThread, seed: int) -> None:
    body = {"messages": USER, "response_format": FORMAT, "max_tokens": 120, "temperature": 1.0, "seed": seed}
    status, out = post(served, CHAT, body)
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(_content(out)), SCHEMA)


def test_json_schema_streamed_and_on_completions(client: Any) -> None:
    stream = client.chat.completions.create(
        model="m", messages=USER, response_format=FORMAT, max_tokens=120, temperature=0.7, seed=5, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    done = client.completions.create(
        model="m", prompt="A pet:", max_tokens=120, temperature=0.7, seed=6, extra_body={"response_format": FORMAT}
    )
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def test_json_object_and_a_gbnf_grammar(served: ServerThread) -> None:
    status, out = post(
        served, CHAT, {"messages": USER, "grammar": 'root ::= "yes" | "no"', "max_tokens": 8, "temperature": 1.0}
    )
    assert status == 200 and _content(out) in ("yes", "no"), out
    ok = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    schema_in_object = {"type": "json_object", "schema": ok}
    status, out = post(served, CHAT, {"messages": USER, "response_format": schema_in_object, "max_tokens": 16})
    assert status == 200 and isinstance(json.loads(_content(out))["ok"], bool), out


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
         "response_format"),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}, "response_format"),
        ("grammar", "root ::= missing_rule", "grammar"),
    ],
    ids=["unknown-type", "dangling-ref", "gbnf-undefined-rule"],
)  # fmt: skip
def test_a_schema_that_cannot_be_compiled_is_a_400(served: ServerThread, field: str, value: Any, param: str) -> None:
    status, out = post(served, CHAT, {"messages": USER, field: value, "max_tokens": 8})
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["code"] == "invalid_schema", out
    assert "compiled" in out["error"]["message"] or "GBNF" in out["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
        ("grammar", 'root ::= "x"{50000}'),
    ],
    ids=["self-reference", "huge-repeat"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_grammar_that_fails_at_its_start_is_invalid_schema_naming_the_field(
    served: ServerThread, field: str, value: Any, stream: bool
) -> None:
    """Compiles, but llguidance fails at its first mask (``$ref: #``: refused before the reply starts,
    400 even when streamed) or at its first token (an item limit: 400, or once streaming, the error
    event): either way ``invalid_schema`` naming the field, with a one-line reason."""
    status, _, data = request(served, "POST", CHAT, {"messages": USER, field: value, "max_tokens": 4, "stream": stream})
    if stream and field == "grammar":  # it fails only once the first token is consumed: the headers went out
        assert status == 200
        errors = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith('data: {"error"')]
        assert len(errors) == 1, data
        out = errors[0]
    else:
        out = json.loads(data)
        assert status == 400, out
    assert out["error"]["param"] == field and out["error"]["code"] == "invalid_schema", out
    message = out["error"]["message"]
    assert "\n" not in message and len(message) < 400, message


def test_malformed_response_formats_are_400(served: ServerThread) -> None:
    for fmt in ({"type": "xml"}, "json", {"type": "json_schema", "json_schema": {"schema": 3}}):
        status, out = post(served, CHAT, {"messages": USER, "response_format": fmt})
        assert status == 400 and out["error"]["param"] == "response_format", out
    status, out = post(served, CHAT, {"messages": USER, "response_format": FORMAT, "grammar": 'root ::= "a"'})
    assert status == 400 and out["error"]["param"] == "grammar", out


def test_without_the_extra_a_json_schema_is_a_400_naming_it(
    served: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # the server thread imports it lazily, per request
    status, out = post(served, CHAT, {"messages": USER, "response_format": FORMAT, "max_tokens": 8})
    assert status == 400, out
    assert "aioexperts[structured]" in out["error"]["message"] and out["error"]["param"] == "response_format"
