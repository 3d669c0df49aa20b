"""llama.cpp's SentencePiece tokenizer (``tokenizer.ggml.model`` = ``llama``): score-driven bigram merges.

A port of ``llm_tokenizer_spm_session::tokenize`` (``src/llama-vocab.cpp``): the text (spaces already
escaped to ``▁``) starts as one symbol per character; the adjacent pair whose concatenation is a token with
the highest score merges first (ties: the leftmost), until no pair is a token. A symbol that is not a
token is split back along the merges that made it (``resegment``), and a single character that is not a
token becomes its UTF-8 bytes as ``<0xXX>`` tokens (byte fallback).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ("spm_tokenize",)


def spm_tokenize(
    text: str,
    token_to_id: dict[str, int],
    scores: list[float],
    byte_to_token: Callable[[int], int],
) -> list[int]:
    """Token ids of ``text`` by llama.cpp's SPM merge loop.

    Args:
        text: the fragment, ``▁`` in place of spaces (and the space prefix already added).
        token_to_id: token text -> id.
        scores: score by id (float32 values).
        byte_to_token: the ``<0xXX>`` token of one byte; raises when the vocabulary has none.

    Returns:
        The ids, in order.
    """
    n = len(text)
    if n == 0:
        return []
    start = list(range(n))
    size = [1] * n  # in characters; 0 = merged into its left neighbour
    prev = [i - 1 for i in range(n)]
    nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
    queue: list[tuple[float, int, int, int]] = []
    rev_merge: dict[str, tuple[int, int]] = {}

    def try_add_bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        piece = text[start[left] : start[left] + size[left] + size[right]]
        token = token_to_id.get(piece)
        if token is None:
            return
        # llama.cpp's comparator: the highest score first, then the smallest left index
        heapq.heappush(queue, (-scores[token], left, right, len(piece)))
        rev_merge[piece] = (left, right)

    for i in range(1, n):
        try_add_bigram(i - 1, i)

    while queue:
        _, left, right, length = heapq.heappop(queue)
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
            continue
        size[left] += size[right]
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add_bigram(prev[left], left)
        try_add_bigram(left, nxt[left])

    out: list[int] = []

    def resegment(index: int) -> None:
        piece = text[start[index] : start[index] + size[index]]
        token = token_to_id.get(piece)
        if token is not None:
            out.append(token)
            return
        split = rev_merge.get(piece)
        if split is None:
            out.extend(byte_to_token(b) for b in piece.encode("utf-8"))
            return
        resegment(split[0])
        resegment(split[1])

    i = 0
    while i != -1:
        resegment(i)
        i = nxt[i]
    return out
