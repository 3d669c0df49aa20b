"""A chat completion's reply read as it streams (:class:`aioexperts.ReplyParser`) into OpenAI's shapes:
``content``, ``reasoning_content`` and ``tool_calls`` deltas, and ``finish_reason: "tool_calls"``
when the reply called a tool.

A streamed call is one delta with its ``index``, ``id``, ``type``, ``name`` and whole ``arguments``
(OpenAI's clients join argument fragments; one fragment is the simplest case). Log-probabilities of
the tokens whose text is held back (it may start a call) go with the next chunk. Under ``tool_choice``
``required`` or a named function the whole reply is held back until it ended and called what was
asked for (:attr:`ChatPrompt.demands_call`): a reply without the call is an error, never content.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aioexperts import Reply, ReplyDelta, SampledToken

from ._openai import Piece, Shapes, Usage, tool_call_json

if TYPE_CHECKING:
    from ._prompt import ChatPrompt

__all__ = ("ChatReply",)


class ChatReply:
    """One chat reply: its parser, the chunks of a stream, the whole response.

    Args:
        shapes: the request's response shapes.
        prompt: the rendered prompt (format, forced call start, tool choice).
        reasoning_format: the server's ``--reasoning-format``.
        include_usage: chunks carry ``usage: null`` (``stream_options.include_usage``).
    """

    def __init__(self, shapes: Shapes, prompt: ChatPrompt, reasoning_format: str, include_usage: bool) -> None:
        self._shapes = shapes
        self._prompt = prompt
        self._parser = prompt.parser(reasoning_format)
        self._include_usage = include_usage
        self._deltas: list[ReplyDelta] = []
        self._pending: list[SampledToken] = []
        self._held: list[dict[str, Any]] = []  # chunks of a reply that must call a tool, until it did
        self._n_calls = 0

    def _chunks(self, deltas: list[ReplyDelta]) -> list[dict[str, Any]]:
        out = []
        for d in deltas:
            self._deltas.append(d)
            if d.tool_call is not None:
                delta: dict[str, Any] = {"tool_calls": [tool_call_json(d.tool_call, self._n_calls)]}
                self._n_calls += 1
            elif d.reasoning:
                delta = {"reasoning_content": d.reasoning}
            else:
                delta = {"content": d.content}
            tokens, self._pending = self._pending, []
            out.append(self._shapes.delta_chunk(delta, tokens, None, self._include_usage))
        return out

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        """The chunks of the next piece of text (none while it may be the start of a call, nor under a
        ``tool_choice`` that demands a call: those come from :meth:`end`)."""
        self._pending.extend(piece.tokens)
        chunks = self._chunks(self._parser.feed(piece.text))
        if self._prompt.demands_call:
            self._held.extend(chunks)
            return []
        return chunks

    def end(self, finish_reason: str) -> list[dict[str, Any]]:
        """The last chunks: what was held back, then the one with the ``finish_reason``.

        Raises:
            APIError: 422 ``tool_choice_not_followed`` (:meth:`ChatPrompt.check`); nothing held back
                is sent then.
        """
        out = [*self._held, *self._chunks(self._parser.finish())]
        self._held = []
        self._prompt.check(Reply.join(self._deltas), finish_reason)
        reason = _finish_reason(bool(self._n_calls), finish_reason)
        out.append(self._shapes.delta_chunk({}, self._pending, reason, self._include_usage))
        self._pending = []
        return out

    def whole(self, pieces: Sequence[Piece], finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The whole response of a request without ``stream``.

        Raises:
            APIError: 422 ``tool_choice_not_followed``.
        """
        reply = self._parser.parse("".join(p.text for p in pieces))
        self._prompt.check(reply, finish_reason)
        reason = _finish_reason(bool(reply.tool_calls), finish_reason)
        tokens = [t for p in pieces for t in p.tokens]
        return self._shapes.whole_reply(reply, tokens, reason, usage)


def _finish_reason(called: bool, finish_reason: str) -> str:
    """``tool_calls`` for a reply that called a tool, unless its token limit ended it: then
    ``length``, since a call may be what did not fit (OpenAI's order)."""
    return "tool_calls" if called and finish_reason != "length" else finish_reason
