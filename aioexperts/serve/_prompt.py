"""A chat request's prompt: the template rendered with its tools and ``chat_template_kwargs``, tokenized,
and what reading the reply needs (the tool-call format, whether the prompt opened a ``<think>`` block).

``tool_choice`` ``"required"`` or a named function is a prompt-level request: the prompt ends with
the start of a call in the template's own syntax (``<tool_call>\\n`` for Hermes/Qwen; for a named
function, up to its arguments: ``<tool_call>\\n{"name": "f", "arguments": ``), so the model
continues a call; nothing constrains the tokens that follow (the ``structured`` extra's grammar engine
is used for ``response_format`` and ``grammar`` only). The reply is then checked: one with no call
(or a call of another function) is answered with a 422 ``tool_choice_not_followed`` error, never as
a plain message, unless it stopped at its token limit (then it comes back as it is, ``finish_reason``
``"length"``: the call may be what did not fit). A streamed reply is held back until it passes the
check (:attr:`ChatPrompt.demands_call`).
422, not 500, as the request cannot be carried out by this model and clients retry a 5xx (OpenAI's
do, twice by default), where a greedy model says the same again. ``"none"`` leaves the tools out of
the prompt and reads no calls.

A template that never reads ``tools`` gets them in a system message (as llama.cpp's generic
format does): their JSON schemas and the ``<tool_call>`` syntax to use. One that never reads
``tool_calls`` gets an assistant's earlier calls in that syntax in its content, and each tool
result inside ``<tool_response>`` (it would otherwise show an empty assistant turn and bare results).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioexperts import Reply, ReplyParser, call_prefix, thinking_open, tool_call_format

from ._errors import APIError

if TYPE_CHECKING:
    from aioexperts import Model

__all__ = ("ChatPrompt", "chat_prompt", "render_chat")

_TOOLS_NOTE = (
    "You may call these functions (JSON schemas):\n{tools}\n"
    'To call one, answer with <tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n'
    "</tool_call> (one block per call)."
)


def _forced(fmt: str, choice: str, template: str) -> str:
    """The start of a call the prompt ends with for ``tool_choice`` ``required`` / ``function:NAME``."""
    if choice == "required":
        return call_prefix(fmt, None, template)
    if choice.startswith("function:"):
        return call_prefix(fmt, choice.removeprefix("function:"), template)
    return ""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered chat prompt and how to read its reply.

    Attributes:
        text: the prompt text (the rendering, then :attr:`forced`).
        ids: its token ids.
        format: the template's tool-call format (:func:`aioexperts.tool_call_format`).
        forced: the start of a call the prompt ends with (``tool_choice`` required or named), else "".
        thinking_open: the rendering ends inside a ``<think>`` block.
        tool_choice: the request's ``tool_choice``.
    """

    text: str
    ids: list[int]
    format: str
    forced: str
    thinking_open: bool
    tool_choice: str

    def parser(self, reasoning_format: str) -> ReplyParser:
        """A :class:`~aioexperts.ReplyParser` for the reply, already past :attr:`forced`."""
        parser = ReplyParser(
            self.format,
            tools=self.tool_choice != "none",
            reasoning=reasoning_format != "none",
            thinking_open=self.thinking_open and not self.forced,
        )
        parser.feed(self.forced)  # the start of a call: nothing comes out before the call ends
        return parser

    @property
    def demands_call(self) -> bool:
        """``tool_choice`` is ``required`` or a named function: the reply must call it (:meth:`check`),
        so a stream sends nothing of it before it ended and passed the check."""
        return self.tool_choice == "required" or self.tool_choice.startswith("function:")

    def check(self, reply: Reply, finish_reason: str) -> None:
        """Raise a 422 ``tool_choice_not_followed`` when the reply ignores ``tool_choice`` required / named.

        A reply cut off by its token limit (``finish_reason`` ``"length"``,
        :attr:`aioexperts.serve._generate.Generation.finish_reason`) is never refused: the call may
        be the part that did not fit, and the client sees the cut in the finish reason (as OpenAI's
        API reports a forced call cut by ``max_tokens``).
        """
        if finish_reason == "length":
            return
        if self.tool_choice == "required" and not reply.tool_calls:
            missing = "no tool call"
        elif self.tool_choice.startswith("function:"):
            name = self.tool_choice.removeprefix("function:")
            others = [c.name for c in reply.tool_calls if c.name != name]
            if reply.tool_calls and not others:
                return
            missing = f"a call of {others[0]!r}" if others else f"no call of {name!r}"
        else:
            return
        raise APIError(
            422,
            f"the model's reply has {missing}, but tool_choice asked for {self.tool_choice!r} (a prompt-level "
            "request here: the prompt starts the call, nothing constrains the tokens); the reply is not sent",
            type="server_error",
            code="tool_choice_not_followed",
        )


def _in_note_syntax(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message for a template that never reads ``tool_calls``: an assistant's calls appended to its
    content as ``<tool_call>`` blocks (the syntax of the tools note), a tool's result wrapped in
    ``<tool_response>`` (as Hermes/Qwen templates write it), so the model sees what it called and
    what came back; other messages as they are."""
    calls = message.get("tool_calls")
    if calls:
        try:
            blocks = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                    allow_nan=False,
                )
                + "\n</tool_call>"
                for c in calls
            )
        except ValueError:  # an arguments object with a number beyond float (1e400 read as inf)
            raise APIError(
                400,
                "an earlier tool call's arguments hold a number beyond the float range, which this "
                "template's tool-call syntax cannot write",
                code="invalid_value",
            ) from None
        text = message.get("content") or ""
        out = {k: v for k, v in message.items() if k != "tool_calls"}
        out["content"] = f"{text}\n{blocks}" if text else blocks
        return out
    if message.get("role") == "tool":
        return {**message, "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    return message


def render_chat(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    tool_choice: str,
    template_kwargs: Mapping[str, Any] | None,
) -> str:
    """The chat template's rendering (with the generation prompt) of a request's messages and tools.

    Raises:
        ChatTemplateError: no template, or it fails.
    """
    template = model.chat_template
    shown = list(tools) if tools and tool_choice != "none" else None
    msgs = list(messages)
    if "tool_calls" not in template.source:  # it would drop earlier calls: written in the note's syntax
        msgs = [_in_note_syntax(m) for m in msgs]
    if shown is not None and "tools" not in template.source:  # the template cannot show them: a system note
        note = _TOOLS_NOTE.format(
            tools="\n".join(json.dumps(t["function"], ensure_ascii=False, allow_nan=False) for t in shown)
        )
        if msgs and msgs[0].get("role") == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{note}"}
        else:
            msgs.insert(0, {"role": "system", "content": note})
        shown = None
    return template.render(msgs, add_generation_prompt=True, tools=shown, extra=template_kwargs)


def chat_prompt(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    tool_choice: str,
    template_kwargs: Mapping[str, Any] | None,
) -> ChatPrompt:
    """Render and tokenize a chat request (runs on the server's text worker).

    The ids are llama.cpp's for a chat prompt (``common/chat.cpp``): special tokens parsed, the
    vocabulary's own BOS/EOS added, and a BOS (EOS) the template wrote itself removed first so it is
    never doubled.

    Raises:
        ChatTemplateError: no template, or it fails.
        TokenizerError: from the tokenizer.
    """
    template = model.chat_template
    rendered = render_chat(model, messages, tools, tool_choice, template_kwargs)
    fmt = tool_call_format(template.source)
    forced = _forced(fmt, tool_choice, template.source)
    text = rendered + forced
    tok = model.tokenizer
    body = text
    if tok.add_bos and template.bos_token and body.startswith(template.bos_token):
        body = body[len(template.bos_token) :]
    if tok.add_eos and template.eos_token and body.endswith(template.eos_token):
        body = body[: -len(template.eos_token)]
    ids = tok.encode(body, add_special=True, parse_special=True)
    return ChatPrompt(text, ids, fmt, forced, thinking_open(rendered), tool_choice)
