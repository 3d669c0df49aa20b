"""A model's reply read into content, reasoning and tool calls, whole or as it streams.

The tool-call syntax is the chat template's (the model was trained on it); :func:`tool_call_format`
chooses it from the template text, as llama.cpp's ``common/chat.cpp`` does
(``common_chat_templates_apply_jinja``: a marker of each format in the template source):

- ``"hermes"``: Hermes 2 Pro, Qwen 2.5/3, QwQ and most ChatML models:
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call (Qwen3-Coder's
  ``<function=f><parameter=p>v</parameter></function>`` inside the block is read too). Also the
  format for a template without any marker.
- ``"llama3"``: Llama 3.1-3.3: the whole reply is ``{"name": "f", "parameters": {...}}`` (after an
  optional ``<|python_tag|>``; several calls separated by ``;``).
- ``"mistral"``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "abcdefghi"}]`` (Mistral
  Nemo, Small 3) or ``[TOOL_CALLS]f[ARGS]{...}`` (Magistral, Devstral, Mistral Small 3.2).
- ``"deepseek"``: DeepSeek V3/R1 ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
  \\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>`` and V3.1's
  ``<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.
- ``"harmony"``: gpt-oss: ``<|channel|>analysis<|message|>...<|end|>`` is reasoning,
  ``<|channel|>final<|message|>...`` content, and a message to ``functions.f``
  (``<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}``) a call.

Reasoning in ``<think>...</think>`` (all formats but harmony) is split off by
:class:`~aioexperts._text.reasoning.ThinkSplitter`. A call that does not parse (bad JSON, no name,
arguments that are not an object) stays content, with its markers, as llama.cpp leaves it.
Whitespace between content and a call, and between calls, is dropped.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigError
from .reasoning import ThinkSplitter, held_back

__all__ = (
    "REASONING_FORMATS",
    "TOOL_CALL_FORMATS",
    "Reply",
    "ReplyDelta",
    "ReplyParser",
    "ToolCall",
    "call_prefix",
    "thinking_open",
    "tool_call_format",
)

TOOL_CALL_FORMATS = ("hermes", "llama3", "mistral", "deepseek", "harmony")
"""The tool-call syntaxes :class:`ReplyParser` reads."""

REASONING_FORMATS = ("none", "auto", "deepseek")
"""llama.cpp's ``--reasoning-format`` values: ``none`` leaves ``<think>`` text in the content;
``auto`` and ``deepseek`` return it apart (``reasoning_content``)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call of the model.

    Attributes:
        name: the function's name.
        arguments: its arguments, a JSON object as text (OpenAI's ``function.arguments``).
        id: the call's id (``call_...``; the model's own for Mistral when it wrote one).
    """

    name: str
    arguments: str
    id: str


@dataclass(frozen=True, slots=True)
class ReplyDelta:
    """A piece of a streamed reply: text of the content, text of the reasoning, or one whole call."""

    content: str = ""
    reasoning: str = ""
    tool_call: ToolCall | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole reply: ``content`` and ``reasoning`` text and the ``tool_calls`` in order."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]

    @classmethod
    def join(cls, deltas: list[ReplyDelta]) -> Reply:
        """The reply the ``deltas`` of a stream make."""
        return cls(
            "".join(d.content for d in deltas),
            "".join(d.reasoning for d in deltas),
            tuple(d.tool_call for d in deltas if d.tool_call is not None),
        )


def tool_call_format(template_source: str) -> str:
    """The tool-call syntax (one of :data:`TOOL_CALL_FORMATS`) of a chat template, from its markers.

    The markers are those llama.cpp's ``common/chat.cpp`` looks for; a template with none of them
    gets ``"hermes"`` (the generic ``<tool_call>`` JSON).
    """
    src = template_source
    if "<|channel|>" in src:
        return "harmony"
    if "tool▁calls▁begin" in src or "tool▁call▁begin" in src:
        return "deepseek"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<tool_call>" in src:
        return "hermes"
    if "<|python_tag|>" in src or ("<|start_header_id|>" in src and "ipython" in src):
        return "llama3"
    return "hermes"


def call_prefix(format: str, name: str | None = None, template_source: str = "") -> str:  # noqa: A002
    """The start of a call in ``format``'s syntax, for a prompt to end with (a prompt-level ``tool_choice``).

    Args:
        format: one of :data:`TOOL_CALL_FORMATS`.
        name: the function to call (its call up to the arguments), or None for any function.
        template_source: the chat template (Mistral: ``[ARGS]`` in it means the ``name[ARGS]`` syntax).

    Returns:
        Text that a :class:`ReplyParser` fed first reads as the start of a call: ``<tool_call>\\n``
        (Hermes), ``<tool_call>\\n{"name": "f", "arguments": `` (Hermes, named), ...

    Raises:
        ConfigError: an unknown ``format``.
    """
    if format not in TOOL_CALL_FORMATS:
        raise ConfigError(f"unknown tool-call format {format!r}: one of {', '.join(TOOL_CALL_FORMATS)}")
    q = json.dumps(name, allow_nan=False)
    if format == "hermes":
        return '<tool_call>\n{"name": ' + q + ', "arguments": ' if name else "<tool_call>\n"
    if format == "llama3":
        return '{"name": ' + q + ', "parameters": ' if name else '{"name": "'
    if format == "mistral":
        if not name:
            return "[TOOL_CALLS]"
        return (
            f"[TOOL_CALLS]{name}[ARGS]"
            if "[ARGS]" in template_source
            else '[TOOL_CALLS][{"name": ' + q + ', "arguments": '
        )
    if format == "deepseek":
        return "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    if name:
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
    return "<|channel|>commentary to=functions."


def thinking_open(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a ``<think>`` block (the template opened it: the reply starts in it)."""
    return prompt.rstrip().endswith("<think>")


def _openai_id() -> str:
    return "call_" + secrets.token_hex(12)


_ALNUM = string.ascii_letters + string.digits


def _mistral_id() -> str:  # Mistral's templates require 9 alphanumerics
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class ReplyParser:
    """Reads a model's reply as it streams: content, reasoning and tool calls.

    Args:
        format: the tool-call syntax, one of :data:`TOOL_CALL_FORMATS` (:func:`tool_call_format`).
        tools: read tool calls (False: a call's text stays content; the request had no tools).
        reasoning: return ``<think>`` text (harmony: the ``analysis`` channel) as reasoning; False
            leaves it in the content (llama.cpp's ``--reasoning-format none``).
        thinking_open: the prompt opened the ``<think>`` block (:func:`thinking_open`).
        new_id: makes a call's id (default ``call_`` and 24 hex digits; Mistral: 9 alphanumerics).

    ``feed(text)`` takes the next piece of the reply and returns the :class:`ReplyDelta` s that are
    certain; ``finish()`` returns the rest at the end of the reply. ``parse(text)`` reads a whole reply.

    Raises:
        ConfigError: an unknown ``format``.
    """

    def __init__(
        self,
        format: str = "hermes",  # noqa: A002 (llama.cpp's word)
        *,
        tools: bool = True,
        reasoning: bool = True,
        thinking_open: bool = False,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        if format not in TOOL_CALL_FORMATS:
            raise ConfigError(f"unknown tool-call format {format!r}: one of {', '.join(TOOL_CALL_FORMATS)}")
        self.format = format
        new_id = new_id or (_mistral_id if format == "mistral" else _openai_id)
        self._think: ThinkSplitter | None = None
        if format == "harmony":
            self._scanner: _Scanner = _Harmony(tools, reasoning, new_id)
        else:
            if reasoning:
                self._think = ThinkSplitter(open_at_start=thinking_open)
            if not tools:
                self._scanner = _Plain()
            elif format == "llama3":
                self._scanner = _Llama3(new_id)
            else:
                self._scanner = _Blocks(format, new_id)
        self._buf = ""
        self._done = False

    def feed(self, text: str) -> list[ReplyDelta]:
        """The deltas ``text`` (the next piece of the reply) makes certain."""
        if self._done:
            raise ConfigError("ReplyParser.feed after finish()")
        if self._think is None:
            return self._scan(text, final=False)
        out: list[ReplyDelta] = []
        for is_reasoning, piece in self._think.feed(text):
            out.extend([ReplyDelta(reasoning=piece)] if is_reasoning else self._scan(piece, final=False))
        return out

    def finish(self) -> list[ReplyDelta]:
        """The deltas left at the end of the reply."""
        if self._done:
            return []
        self._done = True
        out: list[ReplyDelta] = []
        if self._think is not None:
            for is_reasoning, piece in self._think.finish():
                out.extend([ReplyDelta(reasoning=piece)] if is_reasoning else self._scan(piece, final=False))
        out.extend(self._scan("", final=True))
        return out

    def parse(self, text: str) -> Reply:
        """A whole reply read (``feed(text)`` then ``finish()``)."""
        return Reply.join(self.feed(text) + self.finish())

    def _scan(self, text: str, final: bool) -> list[ReplyDelta]:
        self._buf += text
        out: list[ReplyDelta] = []
        while True:
            deltas, used = self._scanner.step(self._buf, final)
            out.extend(deltas)
            self._buf = self._buf[used:]
            if used == 0 or not self._buf:
                break
        if final and self._buf:  # a scanner leaves nothing at the end; this is a guard
            out.append(ReplyDelta(content=self._buf))
            self._buf = ""
        return [d for d in out if d.content or d.reasoning or d.tool_call is not None]


# -- the scanners: step(buffer, final) -> (deltas, characters used) ---------------------------------


class _Scanner:
    def step(self, buf: str, final: bool) -> tuple[list[ReplyDelta], int]:
        raise NotImplementedError


class _Plain(_Scanner):
    def step(self, buf: str, final: bool) -> tuple[list[ReplyDelta], int]:
        return [ReplyDelta(content=buf)], len(buf)


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON object text (None: not an object)."""
    if isinstance(value, str):
        try:
            value = json.loads(value, parse_constant=_no_constant)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _json_call(obj: Any, new_id: Callable[[], str], keep_id: bool = False) -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a call (None: not one)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = _arguments(obj.get("arguments", obj.get("parameters", {})))
    if args is None:
        return None
    given = obj.get("id")
    call_id = given if keep_id and isinstance(given, str) and given else new_id()
    return ToolCall(name, args, call_id)


def _no_constant(name: str) -> Any:
    """``NaN``, ``Infinity``: not JSON (RFC 8259); a reply holding them is not a call."""
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return None


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>]+)>\n?(.*?)\n?</parameter>", re.S)


def _hermes(body: str, new_id: Callable[[], str]) -> list[ToolCall] | None:
    text = body.strip()
    if text.startswith("<function="):  # Qwen3-Coder
        match = _FUNCTION.fullmatch(text)
        if match is None:
            return None
        args: dict[str, Any] = {}
        for name, value in _PARAMETER.findall(match.group(2)):
            parsed = _loads(value)
            args[name] = value if parsed is None else parsed
        return [ToolCall(match.group(1), json.dumps(args, ensure_ascii=False, allow_nan=False), new_id())]
    call = _json_call(_loads(text), new_id)
    return None if call is None else [call]


_DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_DS_CALL_END = "<｜tool▁call▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"
_DS_FENCE = re.compile(r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n?(.*?)\s*```\s*", re.S)


def _deepseek(body: str, new_id: Callable[[], str]) -> list[ToolCall] | None:
    calls = []
    rest = body.strip()
    while rest:
        if not rest.startswith(_DS_CALL_BEGIN):
            return None
        end = rest.find(_DS_CALL_END)
        if end < 0:
            return None
        head, sep, tail = rest[len(_DS_CALL_BEGIN) : end].partition(_DS_SEP)
        if not sep:
            return None
        fenced = _DS_FENCE.fullmatch(tail)
        if head.strip() == "function" and fenced is not None:  # V3 / R1
            name, raw = fenced.group(1), fenced.group(2)
        else:  # V3.1: name<｜tool▁sep｜>{json}
            name, raw = head.strip(), tail
        args = _arguments(_loads(raw))
        if not name or args is None:
            return None
        calls.append(ToolCall(name, args, new_id()))
        rest = rest[end + len(_DS_CALL_END) :].strip()
    return calls or None


def _mistral(body: str, new_id: Callable[[], str]) -> list[ToolCall] | None:
    text = body.strip()
    if text.startswith("["):  # [{"name": ..., "arguments": ..., "id": ...}, ...]
        items = _loads(text)
        if not isinstance(items, list) or not items:
            return None
        read = [_json_call(item, new_id, keep_id=True) for item in items]
        found = [c for c in read if c is not None]
        return found if len(found) == len(read) else None
    calls = []  # name[ARGS]{...}, several joined by [TOOL_CALLS]
    for part in text.split("[TOOL_CALLS]"):
        name, sep, raw = part.partition("[ARGS]")
        name = name.strip()
        args = _arguments(_loads(raw)) if sep else None
        if not name or args is None:
            return None
        calls.append(ToolCall(name, args, new_id()))
    return calls


_BLOCKS: dict[str, tuple[str, str | None, Callable[[str, Callable[[], str]], list[ToolCall] | None]]] = {
    "hermes": ("<tool_call>", "</tool_call>", _hermes),
    "deepseek": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _deepseek),
    "mistral": ("[TOOL_CALLS]", None, _mistral),  # to the end of the reply
}


class _Blocks(_Scanner):
    """Content, then calls between a start and an end marker (no end: to the end of the reply)."""

    def __init__(self, format: str, new_id: Callable[[], str]) -> None:  # noqa: A002
        self.start, self.end, self.read = _BLOCKS[format]
        self.new_id = new_id
        self.in_call = False
        self.after_call = False  # drop the whitespace that follows a call

    def step(self, buf: str, final: bool) -> tuple[list[ReplyDelta], int]:
        if self.in_call:
            end = buf.find(self.end) if self.end is not None else -1
            if end < 0 and not final:
                return [], 0
            body = buf if end < 0 else buf[:end]
            used = len(buf) if end < 0 else end + len(self.end or "")
            self.in_call = False
            calls = self.read(body, self.new_id)
            if calls is None:  # not a call: its text stays content
                self.after_call = False
                return [ReplyDelta(content=self.start + buf[:used])], used
            self.after_call = True
            return [ReplyDelta(tool_call=c) for c in calls], used
        if self.after_call:
            stripped = buf.lstrip()
            if len(stripped) < len(buf):
                return [], len(buf) - len(stripped)
            if not buf:
                return [], 0
        begin = buf.find(self.start)
        if begin >= 0:
            self.in_call = True
            self.after_call = False
            return [ReplyDelta(content=buf[:begin].rstrip())], begin + len(self.start)
        if final:
            return [ReplyDelta(content=buf)], len(buf)
        n = len(buf) - held_back(buf, self.start)
        n = len(buf[:n].rstrip())  # whitespace before a call is dropped: keep it until we know
        if n:
            self.after_call = False
        return [ReplyDelta(content=buf[:n])], n


_PYTHON_TAG = "<|python_tag|>"


class _Llama3(_Scanner):
    """A reply that is a JSON call (after whitespace and an optional ``<|python_tag|>``); else content."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.state = "start"

    def step(self, buf: str, final: bool) -> tuple[list[ReplyDelta], int]:
        if self.state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(("{", _PYTHON_TAG)):
                self.state = "call"
            elif not final and (not stripped or _PYTHON_TAG.startswith(stripped)):
                return [], 0
            else:
                self.state = "text"
        if self.state == "text":
            return [ReplyDelta(content=buf)], len(buf)
        if not final:
            return [], 0
        text = buf.strip().removeprefix(_PYTHON_TAG).strip()
        calls = []
        for part in _split_objects(text):
            call = _json_call(part, self.new_id)
            if call is None:
                return [ReplyDelta(content=buf)], len(buf)
            calls.append(call)
        if not calls:
            return [ReplyDelta(content=buf)], len(buf)
        return [ReplyDelta(tool_call=c) for c in calls], len(buf)


def _split_objects(text: str) -> list[Any]:
    """JSON values separated by ``;`` (or whitespace); ``[None]`` when the text is not that."""
    decoder = json.JSONDecoder(parse_constant=_no_constant)
    out = []
    pos = 0
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return [None]
        out.append(value)
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
    return out


_H_MESSAGE = "<|message|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_HEADS = ("<|channel|>", "<|start|>")
_H_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_H_RECIPIENT = re.compile(r"to=([^\s<]+)")


class _Harmony(_Scanner):
    """gpt-oss's harmony messages: header ``...<|message|>``, body up to ``<|end|>``/``<|call|>``/``<|return|>``."""

    def __init__(self, tools: bool, reasoning: bool, new_id: Callable[[], str]) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.new_id = new_id
        self.state = "header"
        self.kind = "content"
        self.recipient = ""
        self.header = ""

    def step(self, buf: str, final: bool) -> tuple[list[ReplyDelta], int]:
        if self.state == "text":
            return [ReplyDelta(content=buf)], len(buf)
        if self.state == "header":
            stripped = buf.lstrip()
            if not stripped.startswith(_H_HEADS):
                if not final and (not stripped or any(h.startswith(stripped) for h in _H_HEADS)):
                    return [], 0
                self.state = "text"  # no harmony header: plain text
                return [ReplyDelta(content=buf)], len(buf)
            at = buf.find(_H_MESSAGE)
            if at < 0:
                if final:
                    return [ReplyDelta(content=buf)], len(buf)
                return [], 0
            header = buf[:at]
            channel = _H_CHANNEL.search(header)
            recipient = _H_RECIPIENT.search(header)
            self.recipient = recipient.group(1) if recipient else ""
            if self.recipient and self.tools:
                self.kind = "call"
            elif channel is not None and channel.group(1) == "analysis" and self.reasoning:
                self.kind = "reasoning"
            else:
                self.kind = "content"
            self.header = buf[: at + len(_H_MESSAGE)]
            self.state = "body"
            return [], at + len(_H_MESSAGE)
        ends = [i for i in (buf.find(e) for e in _H_ENDS) if i >= 0]
        end = min(ends) if ends else -1
        if self.kind == "call":
            if end < 0 and not final:
                return [], 0
            body = buf if end < 0 else buf[:end]
            used = len(buf) if end < 0 else end + next(len(e) for e in _H_ENDS if buf.startswith(e, end))
            self.state = "header"
            args = _arguments(_loads(body.strip()))
            if args is None:
                return [ReplyDelta(content=self.header + buf[:used])], used
            name = self.recipient.removeprefix("functions.")
            return [ReplyDelta(tool_call=ToolCall(name, args, self.new_id()))], used
        if end >= 0:
            used = end + next(len(e) for e in _H_ENDS if buf.startswith(e, end))
            self.state = "header"
            return [self._text(buf[:end])], used
        n = len(buf) if final else len(buf) - held_back(buf, *_H_ENDS)
        return [self._text(buf[:n])], n

    def _text(self, text: str) -> ReplyDelta:
        return ReplyDelta(reasoning=text) if self.kind == "reasoning" else ReplyDelta(content=text)
