"""Every refusal is the OpenAI error object with the right status, and the server keeps serving.

Context overflow (never truncated), a body over the limit, wrong field types and ranges, features
not supported, a chat template that raises, a wrong or missing API key, unknown paths and methods.
The full queue is in test_cancel_and_load.py.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from aioexperts.serve import ServerOptions
from serve.serving import API_KEY, ServerThread, metrics, post, request

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]


def assert_error(
    status: int, body: Any, want_status: int, *, param: str | None = None, code: str | None = None
) -> None:
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == {401: "authentication_error", 404: "not_found_error"}.get(
        want_status, "server_error" if want_status >= 500 else "invalid_request_error"
    )
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def still_serves(served: ServerThread) -> None:
    status, out = post(served, TEXT, {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] >= 1


def test_prompt_plus_max_tokens_over_n_ctx_is_refused_not_truncated(served: ServerThread) -> None:
    before = metrics(served)
    status, body = post(served, TEXT, {"prompt": "Hello there", "max_tokens": 510})
    assert_error(status, body, 400, param="prompt", code="context_length_exceeded")
    assert "512" in body["error"]["message"] and "510 in the completion" in body["error"]["message"]
    status, body = post(served, CHAT, {"messages": USER, "max_completion_tokens": 512})
    assert_error(status, body, 400, param="messages", code="context_length_exceeded")
    status, body = post(served, TEXT, {"prompt": [5] * 512})  # no max_tokens: the prompt alone fills n_ctx
    assert_error(status, body, 400, param="prompt", code="context_length_exceeded")
    after = metrics(served)
    assert after["aioexperts_prompt_tokens_total"] == before["aioexperts_prompt_tokens_total"]  # nothing ran
    assert after["aioexperts_tokens_prefilled_total"] == before["aioexperts_tokens_prefilled_total"]
    status, body = post(served, TEXT, {"prompt": [5] * 500, "max_tokens": 12, "temperature": 0})
    assert status == 200
    assert {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"} == {
        "prompt_tokens": 500,
        "completion_tokens": 12,
        "total_tokens": 512,
    }
    assert 0 <= body["usage"]["prompt_tokens_details"]["cached_tokens"] < 500
    still_serves(served)


def test_a_body_over_the_limit_is_413(served: ServerThread) -> None:
    big = json.dumps({"prompt": "x" * (70 << 10), "max_tokens": 1}).encode()
    status, _, data = request(served, "POST", TEXT, raw=big)
    assert_error(status, json.loads(data), 413, code="request_too_large")
    assert str(64 << 10) in json.loads(data)["error"]["message"]
    still_serves(served)


def _raw_head(served: ServerThread, length: int, body: bytes) -> socket.socket:
    host, port = served.host_port
    sock = socket.create_connection((host, port), timeout=10)
    head = (
        f"POST {TEXT} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, Any], bytes]:
    """Status, JSON body and the raw head of one response."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)  # socket.timeout (10 s) if the server does not answer
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split()[1]), json.loads(rest[:length]), head


def test_a_declared_length_over_the_limit_is_413_before_any_body_is_read(served: ServerThread) -> None:
    sock = _raw_head(served, 10 << 30, b"{")  # 10 GiB declared, one byte sent
    try:
        status, body, head = _read_response(sock)
    finally:
        sock.close()
    assert_error(status, body, 413, code="request_too_large")
    assert b"Connection: close" in head  # the unread body is not taken for the next request
    still_serves(served)


def test_a_body_that_stalls_is_408_and_its_connection_closed(serve_model: Path) -> None:
    served = ServerThread(serve_model, ServerOptions(port=0, api_key=API_KEY, body_timeout=1.0)).start()
    try:
        sock = _raw_head(served, 100, b"{")  # 100 bytes declared, one sent, then nothing
        try:
            start = time.monotonic()
            status, body, head = _read_response(sock)
            took = time.monotonic() - start
        finally:
            sock.close()
        assert_error(status, body, 408, code="request_timeout")
        assert "within 1 s" in body["error"]["message"] and b"Connection: close" in head and 0.9 < took < 8
        still_serves(served)
    finally:
        served.stop()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (TEXT, {"prompt": "Hi", "temperature": "hot"}, "temperature"),
        (TEXT, {"prompt": "Hi", "temperature": 2.5}, "temperature"),
        (TEXT, {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        (TEXT, {"prompt": "Hi", "max_tokens": 1.5}, "max_tokens"),
        (TEXT, {"prompt": "Hi", "max_tokens": True}, "max_tokens"),
        (TEXT, {"prompt": "Hi", "top_p": 0}, "top_p"),
        (TEXT, {"prompt": "Hi", "presence_penalty": 3}, "presence_penalty"),
        (TEXT, {"prompt": "Hi", "frequency_penalty": "x"}, "frequency_penalty"),
        (TEXT, {"prompt": "Hi", "seed": -1}, "seed"),
        (TEXT, {"prompt": "Hi", "stop": 3}, "stop"),
        (TEXT, {"prompt": "Hi", "stop": ""}, "stop"),  # an empty stop string would stop before any token
        (TEXT, {"prompt": "Hi", "stop": ["\n", ""]}, "stop"),
        (CHAT, {"messages": USER, "stop": [""]}, "stop"),
        (TEXT, {"prompt": "Hi", "logprobs": 21}, "logprobs"),
        (TEXT, {"prompt": "Hi", "stream": "yes"}, "stream"),
        (TEXT, {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
        (TEXT, {"prompt": "Hi", "n": 2}, "n"),
        (TEXT, {"prompt": "Hi", "echo": True}, "echo"),
        (TEXT, {"prompt": ["a", "b"]}, "prompt"),
        (TEXT, {"prompt": ""}, "prompt"),
        (TEXT, {"prompt": 7}, "prompt"),
        (TEXT, {}, "prompt"),
        (TEXT, {"prompt": [1, 2, 100000]}, "prompt"),
        (CHAT, {"messages": "Hi"}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        (CHAT, {"messages": USER, "n": 3}, "n"),
        (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
        (
            CHAT,
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
        ),
        (CHAT, {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        (CHAT, {"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        (CHAT, {"messages": USER, "chat_template_kwargs": 3}, "chat_template_kwargs"),
        (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
        ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
        ("/detokenize", {"tokens": [100000]}, "tokens"),
        ("/tokenize", {"content": 3}, "content"),
        ("/apply-template", {"messages": [{"content": "no role"}]}, "messages[0].role"),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_400_naming_it(
    served: ServerThread, path: str, body: dict[str, Any], param: str
) -> None:
    status, out = post(served, path, body)
    assert_error(status, out, 400, param=param, code="invalid_value")
    assert param.split("[")[0] in out["error"]["message"]


def test_an_infinite_number_is_named_as_such(served: ServerThread) -> None:
    raw = b'{"prompt": "Hi", "temperature": 1e309}'  # valid JSON; Python reads it as inf
    status, _, data = request(served, "POST", TEXT, raw=raw)
    out = json.loads(data)
    assert_error(status, out, 400, param="temperature", code="invalid_value")
    assert "finite" in out["error"]["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"prompt": "Hi", "temperature": NaN}', b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_400(served: ServerThread, raw: bytes) -> None:
    status, _, data = request(served, "POST", TEXT, raw=raw)
    assert_error(status, json.loads(data), 400, code="invalid_json")


def test_a_template_that_raises_is_400_with_its_message(served: ServerThread) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    status, body = post(served, CHAT, {"messages": messages, "max_tokens": 2})
    assert_error(status, body, 400, param="messages", code="chat_template_error")
    assert "system messages are not supported by this template" in body["error"]["message"]
    status, body = post(served, "/apply-template", {"messages": messages})
    assert_error(status, body, 400, code="chat_template_error")
    status, body = post(served, CHAT, {"messages": USER, "max_tokens": 2})  # the same template, no system message
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("key", [None, "wrong-key", ""])
def test_a_wrong_or_missing_api_key_is_401(served: ServerThread, key: str | None) -> None:
    for method, path, body in (
        ("POST", TEXT, {"prompt": "Hi"}),
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
    ):
        status, headers, data = request(served, method, path, body, key=key)
        assert_error(status, json.loads(data), 401, code="invalid_api_key")
        assert headers["www-authenticate"] == "Bearer"
    status, _, _ = request(served, "GET", "/health", key=key)
    assert status == 200  # a probe needs no key
    status, _, _ = request(
        served, "POST", TEXT, {"prompt": "Hi"}, key=None, headers={"Authorization": "Basic dGVzdC1rZXk="}
    )
    assert status == 401
    still_serves(served)


def test_unknown_paths_and_methods_are_error_objects(served: ServerThread) -> None:
    status, _, data = request(served, "GET", "/v1/nothing")
    assert_error(status, json.loads(data), 404, code="not_found")
    status, _, data = request(served, "GET", TEXT)
    assert_error(status, json.loads(data), 405, code="method_not_allowed")
    counted = metrics(served)
    assert counted['aioexperts_requests_total{endpoint="/v1/completions",status="400"}'] >= 1
    assert counted['aioexperts_requests_total{endpoint="/v1/completions",status="405"}'] >= 1  # not "other"
    assert counted['aioexperts_requests_total{endpoint="other",status="404"}'] >= 1
    still_serves(served)


@pytest.mark.parametrize(
    ("path", "message", "param"),
    [
        (CHAT, {"role": "user"}, "messages[0].content"),
        (CHAT, {"role": "user", "content": None}, "messages[0].content"),
        (CHAT, {"role": "user", "content": ""}, "messages[0].content"),
        (CHAT, {"role": "user", "content": []}, "messages[0].content"),
        (CHAT, {"role": "user", "content": [{"type": "text", "text": ""}]}, "messages[0].content"),
        (
            CHAT,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            "messages[0].tool_calls[0].function",
        ),
        (CHAT, {"role": "user", "content": "Hi", "tool_calls": []}, "messages[0].tool_calls"),
        ("/apply-template", {"role": "user", "content": None}, "messages[0].content"),
    ],
)
def test_a_message_without_text_content_is_400(
    served: ServerThread, path: str, message: dict[str, Any], param: str
) -> None:
    """Missing, null or empty content is refused (it once ran 1572 tokens on nothing); an assistant
    message with null content needs well-formed tool_calls, and only an assistant has tool calls."""
    status, out = post(served, path, {"messages": [message], "max_tokens": 2})
    assert_error(status, out, 400, param=param, code="invalid_value")


def test_a_deeply_nested_body_is_a_400_error_object(served: ServerThread) -> None:
    depth = 30_000  # under the 64 KiB body limit, far past the parser's recursion limit
    raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    status, _, data = request(served, "POST", TEXT, raw=raw)
    out = json.loads(data)
    assert_error(status, out, 400, code="invalid_json")
    assert "nested too deeply" in out["error"]["message"]
    still_serves(served)


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (TEXT, b'{"prompt": "Hi \\ud800 there", "max_tokens": 2}', "prompt"),
        (TEXT, b'{"prompt": "Hi", "stop": ["\\udfff"], "max_tokens": 2}', "stop"),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages[0].content"),
        ("/tokenize", b'{"content": "a\\ud800"}', "content"),
    ],
)
def test_a_lone_surrogate_is_400_with_a_code(served: ServerThread, path: str, raw: bytes, param: str) -> None:
    status, _, data = request(served, "POST", path, raw=raw)
    out = json.loads(data)
    assert_error(status, out, 400, param=param, code="invalid_value")
    assert "surrogate" in out["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (TEXT, {"prompt": "Hi", "max_completion_tokens": 3}, "max_completion_tokens"),  # chat's field only
        (TEXT, {"prompt": "Hi", "n_predict": 3}, "n_predict"),
        (CHAT, {"messages": USER, "max_new_tokens": 3}, "max_new_tokens"),
        (CHAT, {"messages": USER, "suffix": "x"}, "suffix"),  # a completions field
        ("/tokenize", {"content": "Hi", "add_bos": True}, "add_bos"),
        ("/detokenize", {"tokens": [1], "skip_special": True}, "skip_special"),
        ("/apply-template", {"messages": USER, "templ": "x"}, "templ"),
        (CHAT, {"messages": [{"role": "user", "content": "Hi", "text": "x"}]}, "messages[0].text"),
        (CHAT, {"messages": USER, "stream": True, "stream_options": {"usage": True}}, "stream_options.usage"),
    ],
)
def test_an_unknown_field_is_400_naming_it(served: ServerThread, path: str, body: dict[str, Any], param: str) -> None:
    status, out = post(served, path, body)
    assert_error(status, out, 400, param=param, code="unknown_parameter")
    assert f"'{param}'" in out["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"store": True}, "store"),
        ({"user": 5}, "user"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ],
)
def test_a_known_field_asking_for_what_is_not_done_is_400(
    served: ServerThread, body: dict[str, Any], param: str
) -> None:
    status, out = post(served, CHAT, {"messages": USER, **body})
    assert_error(status, out, 400, param=param, code="invalid_value")


def test_max_completion_tokens_is_max_tokens_in_chat(served: ServerThread) -> None:
    for fields in ({"max_completion_tokens": 3}, {"max_completion_tokens": 3, "max_tokens": 3}):
        status, out = post(served, CHAT, {"messages": USER, "temperature": 0, **fields})
        assert status == 200 and out["usage"]["completion_tokens"] <= 3, out


@pytest.mark.parametrize(("encoding", "raw"), [("gzip", b"xx"), ("deflate", b"not deflate")])
def test_a_body_that_cannot_be_decoded_is_a_400_error_object(served: ServerThread, encoding: str, raw: bytes) -> None:
    """A body its Content-Encoding does not decode is the client's error: 400 in the API's error
    shape (a new-user trial saw a bare 500 for gzip)."""
    for path in (TEXT, CHAT):
        status, _, data = request(served, "POST", path, raw=raw, headers={"Content-Encoding": encoding})
        out = json.loads(data)
        assert_error(status, out, 400, code="invalid_body")
        assert "could not be read" in out["error"]["message"]
    still_serves(served)
