"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the server's
generation path, as llama.cpp's server offers it (PR #17570).

A request is turned into the chat request of the OpenAI path (the same template rendering, tool-call
parser and sampler): ``system`` (text or text blocks) becomes a system message; a message's content
blocks ``text``, ``tool_use`` (an assistant's call: its ``tool_calls``), ``tool_result`` (a ``tool``
message, before the user's text) and ``thinking`` (the assistant's ``reasoning_content``, which
reasoning templates print) are read; ``image`` and ``document`` blocks are refused. ``tools``
(``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``,
``none``) map to OpenAI's; ``thinking`` ``{"type": "enabled"}`` / ``{"type": "disabled"}`` sets the
template's ``enable_thinking`` (the token budget is not enforced); ``chat_template_kwargs`` is
taken too (llama.cpp's extension). ``max_tokens`` is required, ``stop_sequences`` are stop strings.

The reply is ``content`` blocks (``thinking``, ``text``, ``tool_use``) with ``stop_reason``
``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use``; streamed, it is Anthropic's
events: ``message_start``, ``ping``, ``content_block_start`` / ``content_block_delta``
(``text_delta``, ``thinking_delta``, ``signature_delta``, ``input_json_delta``) /
``content_block_stop``, ``message_delta`` (stop reason and output tokens), ``message_stop``.
Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``; the API key
may come as ``x-api-key`` (Anthropic's header) or ``Authorization: Bearer``. A thinking block's
``signature`` is empty: nothing here signs reasoning.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Callable, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiohttp import web

from aioexperts import AioExpertsError, Reply, ReplyDelta, SamplingOptions, ToolCall
from aioexperts._json import dumps as strict_dumps

from ._errors import APIError, api_error
from ._prompt import ChatPrompt, chat_prompt
from ._tools import parse_template_kwargs, parse_tools
from ._validate import MAX_STOP_STRINGS, GenerationRequest, parse_json

if TYPE_CHECKING:
    from aioexperts import Model

    from ._generate import Generation
    from ._metrics import Metrics
    from ._scheduler import Scheduler

T = TypeVar("T")

__all__ = ("AnthropicMessages", "is_anthropic_path")

_PATH = "/v1/messages"


class _Options(Protocol):
    @property
    def reasoning_format(self) -> str: ...


class MessagesServer(Protocol):
    """What the Messages API needs of :class:`~aioexperts.serve.Server` (its handlers' common parts)."""

    model: Model
    metrics: Metrics
    scheduler: Scheduler
    name: str

    @property
    def options(self) -> _Options: ...

    async def _in_text_worker(self, fn: Callable[[], T]) -> T: ...

    def _fit(self, req: GenerationRequest, n_prompt: int) -> int: ...

    def generation(self, ids: list[int], req: GenerationRequest, max_tokens: int) -> Generation: ...

    def answer_shutdown_cancel(self) -> bool: ...

    def client_gone(self, request: web.Request, resp: web.StreamResponse) -> web.StreamResponse: ...

    async def read_body(self, request: web.Request) -> bytes: ...


#: The body fields of ``POST /v1/messages`` (Anthropic's API reference, 2025), plus llama.cpp's
#: ``chat_template_kwargs``; ``metadata``, ``service_tier`` and ``model`` are accepted and ignored.
MESSAGES_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "metadata",
        "service_tier",
        "chat_template_kwargs",
    }
)
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "chat_template_kwargs"})

#: An HTTP status -> Anthropic's error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_STOP_REASONS = {"eog": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "n_ctx": "max_tokens"}


def is_anthropic_path(path: str) -> bool:
    """Whether errors on ``path`` take Anthropic's shape."""
    return path == _PATH or path.startswith(_PATH + "/")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _kind(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, f"must be a string, got {_kind(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(where, "is not valid Unicode (a lone surrogate)") from None
    return value


def _blocks(content: object, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(where, f"must be a string or an array of content blocks, got {_kind(content)}")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{where}.{i}", "must be a content block object with a 'type'")
    return content


def _block_text(content: object, where: str) -> str:
    """The text of a ``tool_result``'s or ``system``'s content (a string or text blocks)."""
    if content is None:
        return ""
    parts = []
    for i, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            raise _bad(f"{where}.{i}.type", f"only text blocks are supported here, got {block['type']!r}")
        parts.append(_text(block.get("text"), f"{where}.{i}.text"))
    return "".join(parts)


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation in the OpenAI path's form (system, user, assistant with tool_calls, tool)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _block_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty array of messages")
    if isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        raise _bad(
            f"messages.{len(messages) - 1}",
            "a last assistant message (a prefill to continue) is not supported: end with a user message",
        )
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _bad(where, f"must be an object, got {_kind(message)}")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for j, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
            at = f"{where}.content.{j}"
            kind = block["type"]
            if kind == "text":
                texts.append(_text(block.get("text"), f"{at}.text"))
            elif kind == "tool_use" and role == "assistant":
                name, args = block.get("name"), block.get("input", {})
                if not isinstance(name, str) or not name or not isinstance(args, dict):
                    raise _bad(at, "a tool_use block needs a 'name' and an 'input' object")
                call_id = block.get("id")
                calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or not call_id:
                    raise _bad(f"{at}.tool_use_id", "must be the id of the tool_use this answers")
                content = _block_text(block.get("content"), f"{at}.content")
                if block.get("is_error"):
                    content = f"Error: {content}"
                results.append({"role": "tool", "content": content, "tool_call_id": call_id})
            elif kind == "thinking" and role == "assistant":
                reasoning.append(_text(block.get("thinking"), f"{at}.thinking"))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by Anthropic: nothing to show a local model
            else:
                raise _bad(f"{at}.type", f"a {role} message cannot have a {kind!r} block here")
        out.extend(results)
        if texts or calls or reasoning or not results:
            msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if not msg["content"] and not calls and not reasoning:
                raise _bad(f"{where}.content", "is empty: a message needs text, a tool_use or a tool_result")
            out.append(msg)
    return out


def _tools(body: Mapping[str, Any]) -> tuple[tuple[dict[str, Any], ...], str]:
    """Anthropic ``tools`` and ``tool_choice`` as the OpenAI path's."""
    tools = body.get("tools")
    openai_tools: list[dict[str, Any]] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be an array of tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                raise _bad(f"tools.{i}", "only custom tools ({name, description, input_schema}) are supported")
            fn: dict[str, Any] = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
            if tool.get("description") is not None:
                fn["description"] = tool["description"]
            openai_tools.append({"type": "function", "function": fn})
    parsed = parse_tools({"tools": openai_tools} if openai_tools else {})
    choice = body.get("tool_choice")
    if choice is None:
        return parsed, "auto" if parsed else "none"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto" or (kind == "none"):
        return parsed, kind if parsed else "none"
    if kind == "any" and parsed:
        return parsed, "required"
    if kind == "tool" and parsed:
        name = choice.get("name")
        if name not in {t["function"]["name"] for t in parsed}:
            raise _bad("tool_choice.name", f"{name!r} is not one of the tools")
        return parsed, f"function:{name}"
    raise _bad("tool_choice", 'must be {"type": "auto" | "any" | "tool" | "none"} (any and tool need tools)')


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _bad(name, f"must be a number in [{low}, {high}]")
    return float(value)


def _options(body: Mapping[str, Any]) -> SamplingOptions:
    stops = body.get("stop_sequences")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop_sequences", "must be an array of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop_sequences", f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}")
    fields: dict[str, Any] = {"temperature": _number(body, "temperature", 0.0, 1.0)}
    fields["top_p"] = _number(body, "top_p", 0.0, 1.0)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise _bad("top_k", "must be an integer >= 0")
        fields["top_k"] = top_k
    if fields["top_p"] == 0.0:
        raise _bad("top_p", "must be greater than 0")
    if not all(stops):
        raise _bad("stop_sequences", "a stop sequence must not be empty")
    stop = tuple(_text(s, "stop_sequences") for s in stops)
    return SamplingOptions(stop=stop, **{k: v for k, v in fields.items() if v is not None})


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = parse_template_kwargs(body)
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise _bad("thinking", 'must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}')
        kwargs.setdefault("enable_thinking", kind == "enabled")
    return kwargs


def _refuse_unknown(body: Mapping[str, Any], known: frozenset[str], endpoint: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise APIError(400, f"{unknown[0]}: Extra inputs are not permitted ({endpoint})", param=unknown[0])


def parse_messages_request(body: Mapping[str, Any], count_only: bool = False) -> GenerationRequest:
    """A ``POST /v1/messages`` body as the OpenAI path's chat request (400 naming the field at fault)."""
    _refuse_unknown(body, COUNT_FIELDS if count_only else MESSAGES_FIELDS, "POST " + _PATH)
    tools, choice = _tools(body)
    messages = tuple(_messages(body))
    kwargs = _template_kwargs(body)
    max_tokens = body.get("max_tokens")
    if not count_only and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        if max_tokens is None:
            raise _bad("max_tokens", "is required: an integer >= 1")
        raise _bad("max_tokens", f"must be an integer >= 1, got {max_tokens!r:.40}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    return GenerationRequest(
        chat=True,
        messages=messages,
        prompt="",
        options=SamplingOptions() if count_only else _options(body),
        max_tokens=None if count_only else max_tokens,
        stream=stream,
        include_usage=False,
        logprobs=False,
        top_logprobs=0,
        tools=tools,
        tool_choice=choice,
        template_kwargs=kwargs,
    )


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: ".encode() + strict_dumps(data).encode() + b"\n\n"


class _Blocks:
    """Content blocks of a streamed reply: a new block when the kind of delta changes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.n_calls = 0

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            out.append(
                _sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
            )
        out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(
            _sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def events(self, d: ReplyDelta) -> list[bytes]:
        out: list[bytes] = []
        if d.tool_call is not None:
            block = _tool_use(d.tool_call)
            args = block.pop("input")
            out += self._start("tool_use", {**block, "input": {}})
            out.append(
                self._delta(
                    {"type": "input_json_delta", "partial_json": json.dumps(args, ensure_ascii=False, allow_nan=False)}
                )
            )
            out += self.close()
            self.n_calls += 1
        elif d.reasoning:
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        elif d.content:
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.content}))
        return out


class AnthropicMessages:
    """The handlers of ``/v1/messages`` on a :class:`~aioexperts.serve.Server`."""

    def __init__(self, server: MessagesServer) -> None:
        self.server = server

    @staticmethod
    def error_response(err: APIError) -> web.Response:
        """Anthropic's error shape for ``err`` (same HTTP status)."""
        return web.Response(
            text=strict_dumps(AnthropicMessages.error_body(err)),
            status=err.status,
            content_type="application/json",
            headers=err.headers,
        )

    @staticmethod
    def error_body(err: APIError) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(err.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}

    def _prompt(self, req: GenerationRequest) -> ChatPrompt:
        return chat_prompt(self.server.model, req.messages, req.tools, req.tool_choice, req.template_kwargs)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}`` of the rendered prompt."""
        req = parse_messages_request(parse_json(await self.server.read_body(request)), count_only=True)
        prompt = await self.server._in_text_worker(lambda: self._prompt(req))
        return web.json_response({"input_tokens": len(prompt.ids)})

    async def create(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages``."""
        server = self.server
        req = parse_messages_request(parse_json(await server.read_body(request)))
        prompt = await server._in_text_worker(lambda: self._prompt(req))
        max_tokens = server._fit(req, len(prompt.ids))
        msg_id = "msg_" + secrets.token_hex(12)
        async with server.scheduler.slot():
            gen = server.generation(prompt.ids, req, max_tokens)
            try:
                if req.stream:
                    return await self._stream(request, prompt, gen, msg_id)
                async with aclosing(gen.pieces()) as stream:
                    text = "".join([piece.text async for piece in stream])
                parser = prompt.parser(server.options.reasoning_format)
                reply = parser.parse(text)
                prompt.check(reply, gen.finish_reason)
                content: list[dict[str, Any]] = []
                if reply.reasoning:
                    content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
                if reply.content:
                    content.append({"type": "text", "text": reply.content})
                content.extend(_tool_use(c) for c in reply.tool_calls)
                body = self._message(msg_id, content, gen, bool(reply.tool_calls))
                return web.Response(text=strict_dumps(body), content_type="application/json")
            except ConnectionResetError:
                server.metrics.cancelled += 1
                raise
            except asyncio.CancelledError:
                if req.stream or not server.answer_shutdown_cancel():
                    server.metrics.cancelled += 1
                    raise
                return self.error_response(_shutting_down())

    def _stop(self, gen: Generation, called: bool) -> tuple[str, str | None]:
        st = gen.statistics
        reason = _STOP_REASONS.get(st.stop_reason or "", "end_turn")
        if called and reason != "max_tokens":  # a reply its token limit ended says so, call or not
            return "tool_use", None
        return reason, st.stop_string

    def _message(self, msg_id: str, content: list[dict[str, Any]], gen: Generation, called: bool) -> dict[str, Any]:
        reason, sequence = self._stop(gen, called)
        usage = gen.usage
        return {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.server.name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens},
        }

    async def _stream(
        self, request: web.Request, prompt: ChatPrompt, gen: Generation, msg_id: str
    ) -> web.StreamResponse:
        server = self.server
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
        start = {**self._message(msg_id, [], gen, False), "stop_reason": None, "stop_sequence": None}
        start["usage"] = {"input_tokens": len(prompt.ids), "output_tokens": 0}
        try:
            await self._stream_events(resp, prompt, gen, start)
        except ConnectionResetError:  # any write, the error event's and the last one's included
            return server.client_gone(request, resp)
        return resp

    async def _stream_events(
        self, resp: web.StreamResponse, prompt: ChatPrompt, gen: Generation, start: dict[str, Any]
    ) -> None:
        server = self.server
        parser = prompt.parser(server.options.reasoning_format)
        blocks = _Blocks()
        deltas: list[ReplyDelta] = []
        held: list[bytes] | None = [] if prompt.demands_call else None  # sent once the reply called the tool

        async def send(events: bytes) -> None:
            if held is not None:
                held.append(events)
            else:
                await resp.write(events)

        try:
            await resp.write(_sse("message_start", {"type": "message_start", "message": start}))
            await resp.write(_sse("ping", {"type": "ping"}))
            async with aclosing(gen.pieces()) as pieces:
                async for piece in pieces:
                    for d in parser.feed(piece.text):
                        deltas.append(d)
                        await send(b"".join(blocks.events(d)))
            for d in parser.finish():
                deltas.append(d)
                await send(b"".join(blocks.events(d)))
            await send(b"".join(blocks.close()))
            # tool_choice any / tool not followed: nothing held is sent (unless the reply was cut off)
            prompt.check(Reply.join(deltas), gen.finish_reason)
            if held:
                await resp.write(b"".join(held))
            reason, sequence = self._stop(gen, blocks.n_calls > 0)
            delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
            delta["usage"] = {"output_tokens": gen.usage.completion_tokens}
            await resp.write(_sse("message_delta", delta) + _sse("message_stop", {"type": "message_stop"}))
        except AioExpertsError as exc:  # after the headers went out: an error event ends the stream
            await resp.write(_sse("error", self.error_body(api_error(exc))))
        except asyncio.CancelledError:
            if not server.answer_shutdown_cancel():
                raise
            with contextlib.suppress(Exception):
                await asyncio.wait_for(resp.write(_sse("error", self.error_body(_shutting_down()))), 1.0)
        await resp.write_eof()


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
