"""Request bodies checked field by field into a :class:`GenerationRequest` (400 with the field named).

The fields and ranges are OpenAI's (``POST /v1/chat/completions``, ``POST /v1/completions``), plus
llama.cpp server's sampling extensions ``top_k``, ``min_p`` and ``repeat_penalty``. A field given as
JSON ``null`` counts as absent. Sampling fields not given take llama.cpp's defaults
(:class:`aioexperts.SamplingOptions`: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05).
Features this server does not have (``n`` other than 1, ``best_of``, ``echo``, ``suffix``,
``logit_bias``, ...) are refused, never ignored (``response_format`` and ``grammar``:
:mod:`aioexperts.serve._structured`); so is a field the endpoint does not know (:data:`CHAT_FIELDS`,
:data:`COMPLETION_FIELDS`: 400 ``unknown_parameter`` naming it). ``tools``, ``tool_choice``, a
message's ``tool_calls`` and ``chat_template_kwargs`` are read by :mod:`._tools`. Every message
needs non-empty text content (but an assistant message with ``tool_calls``), and text must be
valid Unicode (no lone surrogates).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioexperts import ConfigError, SamplingOptions

from ._errors import APIError
from ._structured import StructuredOutput, parse_structured
from ._tools import (
    no_json_constant,
    parse_template_kwargs,
    parse_tool_call_id,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
)

__all__ = (
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "DETOKENIZE_FIELDS",
    "TOKENIZE_FIELDS",
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "GenerationRequest",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_json",
    "parse_messages",
    "parse_template_request",
    "parse_token_ids",
    "parse_tokenize",
    "refuse_unknown",
)

MAX_STOP_STRINGS = 16
"""Stop strings one request may give (OpenAI allows 4; llama.cpp's server has no limit)."""

MAX_TOP_LOGPROBS = 20
"""``top_logprobs`` (chat) and ``logprobs`` (completions) at most (OpenAI's bound for chat)."""

_MAX_INT = 2**31 - 1

#: The body fields of each endpoint: OpenAI's (its API reference, 2025) plus llama.cpp's sampling
#: extensions. Each is implemented, accepted and ignored (hints with no effect here: ``user``,
#: ``metadata``, ...) or refused when it asks for what this server does not do
#: (:func:`_refuse_unsupported`); a field not listed is refused as unknown (400 naming it).
_EXTENSIONS = frozenset({"top_k", "min_p", "repeat_penalty", "grammar"})
_COMMON_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "frequency_penalty",
        "presence_penalty",
        "seed",
        "stop",
        "n",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "user",
    }
)
CHAT_FIELDS = (
    _COMMON_FIELDS
    | _EXTENSIONS
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "moderation",
        "reasoning_effort",
        "verbosity",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "chat_template_kwargs",
    }
)
"""The fields ``POST /v1/chat/completions`` knows."""
COMPLETION_FIELDS = _COMMON_FIELDS | _EXTENSIONS | {"prompt", "best_of", "echo", "suffix", "response_format"}
"""The fields ``POST /v1/completions`` knows."""
TOKENIZE_FIELDS = frozenset({"model", "content", "add_special", "parse_special", "with_pieces"})
"""The fields of llama.cpp server's ``POST /tokenize`` (``model`` ignored)."""
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
"""The fields of ``POST /detokenize``."""
_ROLES = ("system", "developer", "user", "assistant", "tool")
#: A message's fields (OpenAI's, and llama.cpp's ``reasoning_content``); ``function_call`` and audio are refused.
_MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio", "reasoning_content"}
)
#: ``stream_options``' fields: ``include_obfuscation`` (padding against side channels) is accepted and ignored.
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One checked completion request.

    Attributes:
        chat: a chat completion (``messages``) rather than a text completion (``prompt``).
        messages: the conversation (chat), ``{"role", "content"}`` dicts with str content.
        prompt: the prompt text or token ids (completions).
        options: the sampling options, ``max_tokens`` not yet set (it depends on the prompt's length).
        max_tokens: tokens to generate at most; None: until an end-of-generation token or ``n_ctx``.
        stream: answer with server-sent events.
        include_usage: ``stream_options.include_usage``: a last chunk with the usage.
        logprobs: log-probabilities of each chosen token (chat ``logprobs``; completions ``logprobs``
            not None).
        top_logprobs: the most likely alternatives reported per token (0 to :data:`MAX_TOP_LOGPROBS`).
        structured: the grammar the output must follow (``response_format``, ``grammar``), or None.
        tools: the function tools (chat), for the template and the reply's parser.
        tool_choice: ``"auto"``, ``"none"``, ``"required"`` or ``"function:NAME"``.
        template_kwargs: ``chat_template_kwargs``: more variables for the chat template.
    """

    chat: bool
    messages: tuple[dict[str, Any], ...]
    prompt: str | tuple[int, ...]
    options: SamplingOptions
    max_tokens: int | None
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    structured: StructuredOutput | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "none"
    template_kwargs: Mapping[str, Any] | None = None


def parse_json(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body (400 unless it is one; NaN and Infinity are not JSON)."""
    try:
        value = json.loads(body, parse_constant=no_json_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # arrays or objects nested deeper than the parser's recursion allows
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, not {_kind(value)}", code="invalid_json")
    return value


def _kind(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}': {message}", param=param, code="invalid_value")


def _text(value: str, param: str) -> str:
    """``value``, unless it holds a lone surrogate (JSON's ``"\\ud800"``): not text, it cannot be tokenized."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = f"U+{ord(value[exc.start]):04X}"
        raise _bad(param, f"is not valid Unicode: a lone surrogate {bad} at index {exc.start}") from None
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"must be a boolean, got {_kind(value)}")
    return value


def _int(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {_kind(value)}")
    if not low <= value <= high:
        raise _bad(name, f"must be in [{low}, {high}], got {value}")
    return value


def _number(body: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"must be a number, got {_kind(value)}")
    if isinstance(value, int) and abs(value) > 2**64:  # math.isfinite raises OverflowError past float's range
        raise _bad(name, f"must be a number in [{low}, {high}], got an integer of {len(str(value))} digits")
    if not math.isfinite(value):
        raise _bad(name, f"must be a finite number in [{low}, {high}], got {value}")
    if value < low or value > high or (low_open and value == low):
        raise _bad(name, f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


def refuse_unknown(body: Mapping[str, Any], known: frozenset[str], endpoint: str) -> None:
    """400 ``unknown_parameter`` naming the first field of ``body`` not in ``known`` (never ignored)."""
    unknown = sorted(name for name in body if name not in known)
    if unknown:
        name = unknown[0]
        raise APIError(
            400,
            f"Unknown parameter: '{name}' ({endpoint} does not take it)",
            param=name,
            code="unknown_parameter",
        )


def _str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad(name, f"must be a string, got {_kind(value)}")
    return value


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    n = _int(body, "n", 1, _MAX_INT)
    if n not in (None, 1):
        raise _bad("n", f"only n=1 is supported (one choice per request), got {n}")
    best_of = _int(body, "best_of", 1, _MAX_INT)
    if best_of not in (None, 1):
        raise _bad("best_of", f"only best_of=1 is supported, got {best_of}")
    if _bool(body, "echo", False):
        raise _bad("echo", "echoing the prompt is not supported")
    for name in ("suffix", "logit_bias", "functions", "function_call", "audio", "prediction"):
        if body.get(name):
            raise _bad(name, "is not supported by this server")
    for name in ("web_search_options", "reasoning_effort", "verbosity", "moderation"):  # other models only
        if body.get(name) is not None:
            raise _bad(name, "is not supported by this model")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _bad("modalities", 'only ["text"] is supported')
    if _bool(body, "store", False):
        raise _bad("store", "storing completions is not supported by this server")
    _bool(body, "parallel_tool_calls", True)  # meaningful with tools only: checked, else ignored
    for name in ("model", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier"):
        _str(body, name)  # accepted and ignored (one model; hints for OpenAI's own service)
    for name in ("metadata", "prompt_cache_options"):
        value = body.get(name)
        if value is not None and not isinstance(value, dict):
            raise _bad(name, f"must be an object, got {_kind(value)}")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "must be a string or an array of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if not all(stops):  # llama.cpp would stop before the first token; OpenAI refuses it too
        raise _bad("stop", "a stop string must not be empty")
    return tuple(_text(s, "stop") for s in stops)


def _sampling(body: Mapping[str, Any]) -> SamplingOptions:
    fields: dict[str, Any] = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, low_open=True),
        "top_k": _int(body, "top_k", 0, _MAX_INT),
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "repeat_penalty": _number(body, "repeat_penalty", 0.0, 10.0, low_open=True),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
        "seed": _int(body, "seed", 0, 2**64 - 1),
    }
    try:
        return SamplingOptions(stop=_stop(body), **{k: v for k, v in fields.items() if v is not None})
    except ConfigError as exc:  # the ranges above are SamplingOptions' or narrower: a bug if reached
        raise APIError(400, str(exc), code="invalid_value") from None


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise _bad("stream_options", "is only allowed when 'stream' is true")
    if not isinstance(opts, dict):
        raise _bad("stream_options", f"must be an object, got {_kind(opts)}")
    unknown = sorted(set(opts) - _STREAM_OPTIONS)
    if unknown:
        name = f"stream_options.{unknown[0]}"
        raise APIError(400, f"Unknown parameter: '{name}'", param=name, code="unknown_parameter")
    _bool(opts, "include_obfuscation", False)
    return stream, _bool(opts, "include_usage", False)


def _max_tokens(body: Mapping[str, Any], chat: bool) -> int | None:
    """``max_tokens``; in chat also ``max_completion_tokens``, its new name (both given: they must agree)."""
    value = _int(body, "max_tokens", 1, _MAX_INT)
    if chat:
        newer = _int(body, "max_completion_tokens", 1, _MAX_INT)
        if newer is not None and value is not None and newer != value:
            raise _bad(
                "max_completion_tokens",
                f"is {newer} but max_tokens is {value}: they mean the same, give one (or the same value)",
            )
        if newer is not None:
            return newer
    return value


#: roles whose content may be empty: a reply cut at its start (a stop string, an immediate end of
#: generation) and a tool's empty output come back in an agent's history, as OpenAI accepts them
_MAY_BE_EMPTY = frozenset(("assistant", "tool"))


def _content(value: object, where: str, may_be_empty: bool = False) -> str:
    if isinstance(value, list):  # content parts: only text ones
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(where, "only text content parts ({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        value = "".join(texts)
    if value is None:  # missing or null (an assistant message with tool_calls is read by _message)
        raise _bad(where, "is missing: every message needs text content")
    if not isinstance(value, str):
        raise _bad(where, f"must be a string or an array of text parts, got {_kind(value)}")
    if not value:
        if may_be_empty:
            return ""
        raise _bad(where, "is empty: a user or system message needs text content")
    return _text(value, where)


def _message(message: Mapping[str, Any], role: str, i: int) -> dict[str, Any]:
    """One message for the template: ``role`` and ``content``, an assistant's ``tool_calls``, a tool's
    ``tool_call_id`` (and ``name``)."""
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise _bad(f"messages[{i}].tool_calls", "only an assistant message has tool calls")
    if calls is not None and not message.get("content"):  # an assistant that only called: no text
        out: dict[str, Any] = {"role": role, "content": ""}
    else:
        content = _content(message.get("content"), f"messages[{i}].content", role in _MAY_BE_EMPTY)
        out = {"role": role, "content": content}
    if calls is not None:
        out["tool_calls"] = parse_tool_calls(calls, f"messages[{i}].tool_calls")
    reasoning = message.get("reasoning_content")
    if reasoning is not None:  # llama.cpp's field: the reasoning templates print it (Qwen3, DeepSeek)
        where = f"messages[{i}].reasoning_content"
        if role != "assistant" or not isinstance(reasoning, str):
            raise _bad(where, "must be a string, on an assistant message")
        if reasoning:
            out["reasoning_content"] = _text(reasoning, where)
    if role == "tool":
        if message.get("tool_call_id") is not None:
            out["tool_call_id"] = parse_tool_call_id(message["tool_call_id"], f"messages[{i}].tool_call_id")
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    return out


def parse_messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """The ``messages`` of a chat request (or of ``/apply-template``), each ``{"role", "content"}``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty array of messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", f"must be an object, got {_kind(message)}")
        role = message.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
        unknown = sorted(set(message) - _MESSAGE_FIELDS)
        if unknown:
            raise APIError(
                400,
                f"Unknown parameter: 'messages[{i}].{unknown[0]}' (a message has {', '.join(sorted(_MESSAGE_FIELDS))})",
                param=f"messages[{i}].{unknown[0]}",
                code="unknown_parameter",
            )
        for name in ("function_call", "audio"):
            if message.get(name) is not None:
                raise _bad(f"messages[{i}].{name}", "is not supported by this server (use tool_calls)")
        out.append(_message(message, role, i))
    return tuple(out)


def parse_template_request(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """A ``POST /apply-template`` body: a chat request's (llama.cpp's), of which only ``messages`` matters."""
    refuse_unknown(body, CHAT_FIELDS, "POST /apply-template")
    _refuse_unsupported(body)  # tools would change the rendering
    return parse_messages(body)


def parse_detokenize(body: Mapping[str, Any]) -> tuple[int, ...]:
    """A ``POST /detokenize`` body: its ``tokens``."""
    refuse_unknown(body, DETOKENIZE_FIELDS, "POST /detokenize")
    _str(body, "model")
    tokens = body.get("tokens")
    if isinstance(tokens, list) and not tokens:
        return ()  # what /tokenize gives for "" (llama.cpp's server answers "" too)
    return parse_token_ids(tokens, "tokens")


def parse_token_ids(value: object, param: str) -> tuple[int, ...]:
    """A non-empty array of non-negative integers (the range against the vocabulary is the model's check)."""
    if not isinstance(value, list) or not value:
        raise _bad(param, "must be a non-empty array of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise _bad(param, "token ids must be non-negative integers")
    return tuple(value)


def parse_tokenize(body: Mapping[str, Any]) -> tuple[str, dict[str, bool]]:
    """A ``POST /tokenize`` body: its ``content`` and the flags ``add_special``, ``parse_special``, ``with_pieces``."""
    refuse_unknown(body, TOKENIZE_FIELDS, "POST /tokenize")
    _str(body, "model")
    content = body.get("content")
    if not isinstance(content, str):
        raise _bad("content", f"must be a string, got {_kind(content)}")
    flags = {
        "add_special": _bool(body, "add_special", False),
        "parse_special": _bool(body, "parse_special", True),
        "with_pieces": _bool(body, "with_pieces", False),
    }
    return _text(content, "content"), flags


def _prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # ["text"] or [[ids]]: one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "is empty: there is nothing to continue")
        return _text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise _bad("prompt", f"one prompt per request (n=1), got {len(prompt)}")
    if isinstance(prompt, list):
        return parse_token_ids(prompt, "prompt")
    raise _bad("prompt", f"must be a string or an array of token ids, got {_kind(prompt)}")


def parse_chat(body: Mapping[str, Any]) -> GenerationRequest:
    """A ``POST /v1/chat/completions`` body (400 :class:`APIError` naming the field at fault)."""
    refuse_unknown(body, CHAT_FIELDS, "POST /v1/chat/completions")
    _refuse_unsupported(body)
    messages = parse_messages(body)
    stream, include_usage = _stream(body)
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise _bad("top_logprobs", "needs 'logprobs': true")
    tools = parse_tools(body)
    return GenerationRequest(
        chat=True,
        messages=messages,
        prompt="",
        options=_sampling(body),
        max_tokens=_max_tokens(body, chat=True),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top or 0,
        structured=parse_structured(body),
        tools=tools,
        tool_choice=parse_tool_choice(body, tools),
        template_kwargs=parse_template_kwargs(body),
    )


def parse_completion(body: Mapping[str, Any]) -> GenerationRequest:
    """A ``POST /v1/completions`` body (400 :class:`APIError` naming the field at fault)."""
    refuse_unknown(body, COMPLETION_FIELDS, "POST /v1/completions")
    _refuse_unsupported(body)
    prompt = _prompt(body)
    stream, include_usage = _stream(body)
    top = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    return GenerationRequest(
        chat=False,
        messages=(),
        prompt=prompt,
        options=_sampling(body),
        max_tokens=_max_tokens(body, chat=False),
        stream=stream,
        include_usage=include_usage,
        logprobs=top is not None,
        top_logprobs=top or 0,
        structured=parse_structured(body),
    )
