"""Reasoning text apart from the reply: ``<think>...</think>`` (DeepSeek-R1, Qwen3, QwQ, GLM, ...).

:class:`ThinkSplitter` reads a reply as it streams and says, for each piece of text, whether it is
reasoning or content, as llama.cpp's ``--reasoning-format deepseek`` does (``common/chat.cpp``,
``common_chat_parse_reasoning``): a ``<think>`` block at the start of the reply (after whitespace)
is reasoning, the text after ``</think>`` (leading whitespace dropped) is content. A template that
opens the block itself (its generation prompt ends with ``<think>``) starts the reply inside it:
``open_at_start=True``. A reply that ends inside the block keeps it as reasoning. A ``<think>``
later in the reply is content.

Text is never lost nor reordered: a piece that could be the start of a tag is held back until the
next piece (or :meth:`ThinkSplitter.finish`) tells.
"""

from __future__ import annotations

__all__ = ("THINK_END", "THINK_START", "ThinkSplitter", "held_back")

THINK_START = "<think>"
THINK_END = "</think>"


def held_back(text: str, *markers: str) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers`` (to keep for later)."""
    keep = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), keep, -1):
            if text.endswith(marker[:k]):
                keep = k
                break
    return keep


class ThinkSplitter:
    """Splits a streamed reply into reasoning and content pieces.

    Args:
        open_at_start: the prompt opened the ``<think>`` block (the reply starts inside it).

    ``feed(text)`` and ``finish()`` return ``(is_reasoning, text)`` pairs with non-empty text.
    """

    def __init__(self, *, open_at_start: bool = False) -> None:
        self._state = "reasoning" if open_at_start else "start"
        self._buf = ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[bool, str]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        while self._buf:
            buf = self._buf
            if self._state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._buf = stripped[len(THINK_START) :]
                    self._state = "reasoning"
                elif not final and (not stripped or THINK_START.startswith(stripped)):
                    break  # only whitespace, or a part of "<think>": wait
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                end = buf.find(THINK_END)
                if end >= 0:
                    if end:
                        out.append((True, buf[:end]))
                    self._buf = buf[end + len(THINK_END) :]
                    self._state = "after"
                else:
                    n = len(buf) if final else len(buf) - held_back(buf, THINK_END)
                    if n:
                        out.append((True, buf[:n]))
                    self._buf = buf[n:]
                    break
            elif self._state == "after":  # whitespace after </think> is dropped
                stripped = buf.lstrip()
                self._buf = stripped
                if stripped:
                    self._state = "content"
                else:
                    break
            else:
                out.append((False, buf))
                self._buf = ""
        return out
