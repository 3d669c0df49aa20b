"""The JSON shapes of OpenAI's chat and text completion responses, whole and as stream chunks.

A generation is handed over as :class:`Piece` s (decoded text and the sampled tokens that made it);
:class:`Shapes` turns them into ``chat.completion`` / ``chat.completion.chunk`` or
``text_completion`` objects, with OpenAI's ``logprobs`` layouts (chat: ``content`` entries with
``token``, ``logprob``, ``bytes``, ``top_logprobs``; completions: ``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) and ``usage``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aioexperts import Reply, SampledToken, Tokenizer, ToolCall

__all__ = ("FINISH_REASONS", "Piece", "Shapes", "Usage", "tool_call_json")

#: ``GenerationStatistics.stop_reason`` -> OpenAI's ``finish_reason``.
FINISH_REASONS = {"eog": "stop", "stop": "stop", "length": "length", "n_ctx": "length"}


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` item (with ``index`` in a stream delta)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update(id=call.id, type="function", function={"name": call.name, "arguments": call.arguments})
    return out


@dataclass(frozen=True, slots=True)
class Piece:
    """Text handed out at once, and the tokens sampled for it (with log-probabilities when asked)."""

    text: str
    tokens: Sequence[SampledToken]


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of the prompt and of the completion; ``cached_tokens``: prompt tokens the prompt cache
    held (not prefilled again), OpenAI's ``usage.prompt_tokens_details.cached_tokens``."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Shapes:
    """Response objects of one request.

    Args:
        chat: chat completion (else text completion).
        model: the model's name in responses.
        tokenizer: gives each token's text and bytes for ``logprobs``.
        logprobs: report log-probabilities.
        top_logprobs: alternatives per token.
        fingerprint: ``system_fingerprint``.
    """

    def __init__(
        self, chat: bool, model: str, tokenizer: Tokenizer, logprobs: bool, top_logprobs: int, fingerprint: str
    ) -> None:
        self.chat = chat
        self.model = model
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.fingerprint = fingerprint
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self._offset = 0  # characters handed out so far (completions' text_offset)

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def _piece_bytes(self, token: int) -> bytes:
        return self.tokenizer.piece(token)

    def _chat_logprobs(self, tokens: Sequence[SampledToken]) -> dict[str, Any]:
        def entry(token: int, logprob: float | None) -> dict[str, Any]:
            raw = self._piece_bytes(token)
            return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

        content = []
        for t in tokens:
            item = entry(t.token, t.logprob)
            item["top_logprobs"] = [entry(i, lp) for i, lp in t.top_logprobs[: self.top_logprobs]]
            content.append(item)
        return {"content": content, "refusal": None}

    def _text_logprobs(self, tokens: Sequence[SampledToken], offset: int) -> dict[str, Any]:
        texts = [self._piece_bytes(t.token).decode("utf-8", "replace") for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [self._text_top(t) for t in tokens],
            "text_offset": offsets,
        }

    def _text_top(self, token: SampledToken) -> dict[str, float]:
        """The legacy ``{text: logprob}`` of the most likely tokens; tokens whose text is the same (a
        partial UTF-8 sequence shown as U+FFFD) keep the likelier one, listed first."""
        top: dict[str, float] = {}
        for i, lp in token.top_logprobs[: self.top_logprobs]:
            top.setdefault(self._piece_bytes(i).decode("utf-8", "replace"), lp)
        return top

    def _logprobs(self, tokens: Sequence[SampledToken], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return self._chat_logprobs(tokens) if self.chat else self._text_logprobs(tokens, offset)

    # -- streaming ----------------------------------------------------------------------------------

    def chunk(self, piece: Piece | None, finish_reason: str | None, include_usage: bool) -> dict[str, Any]:
        """A stream chunk with ``piece`` (None: the role-only first chat chunk, or the last one)."""
        text = piece.text if piece is not None else ""
        logprobs = self._logprobs(piece.tokens, self._offset) if piece is not None else None
        self._offset += len(text)
        if self.chat:
            if piece is None and finish_reason is None:
                delta: dict[str, Any] = {"role": "assistant", "content": ""}
            else:
                delta = {"content": text} if piece is not None else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            out = self._head("text_completion")
        out["choices"] = [choice]
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage.as_json()
        return out

    def delta_chunk(
        self, delta: dict[str, Any], tokens: Sequence[SampledToken], finish_reason: str | None, include_usage: bool
    ) -> dict[str, Any]:
        """A chat stream chunk with ``delta`` (``content``, ``reasoning_content`` or ``tool_calls``)."""
        logprobs = self._logprobs(tokens, 0) if tokens else None
        out = self._head("chat.completion.chunk")
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        if include_usage:
            out["usage"] = None
        return out

    def whole_reply(
        self, reply: Reply, tokens: Sequence[SampledToken], finish_reason: str, usage: Usage
    ) -> dict[str, Any]:
        """The whole chat response of a parsed reply: ``content`` (null when only calls), ``reasoning_content``
        (when there is reasoning), ``tool_calls`` (when there are calls)."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.content if reply.content or not reply.tool_calls else None,
            "refusal": None,
        }
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [tool_call_json(c) for c in reply.tool_calls]
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(tokens, 0), "finish_reason": finish_reason}
        out = self._head("chat.completion")
        out["choices"] = [choice]
        out["usage"] = usage.as_json()
        return out

    # -- whole --------------------------------------------------------------------------------------

    def whole(self, pieces: Sequence[Piece], finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The whole response of a request without ``stream``."""
        text = "".join(p.text for p in pieces)
        tokens = [t for p in pieces for t in p.tokens]
        logprobs = self._logprobs(tokens, 0)
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            out = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            out = self._head("text_completion")
        out["choices"] = [choice]
        out["usage"] = usage.as_json()
        return out
