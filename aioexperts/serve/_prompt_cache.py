"""The prompt cache across requests: finished sequences keep their KV cache in a pool bounded in bytes.

A request :meth:`~PromptCache.take` s the pooled sequence whose tokens share the longest prefix
with its prompt (it leaves the pool: a sequence being written is never shared by two requests);
:meth:`aioexperts.Model.stream` with ``sequence=`` keeps that prefix and prefills only the rest (as
llama.cpp's server reuses a slot's prompt, ``cache_prompt``). A generation that ends normally
:meth:`~PromptCache.put` s its sequence back, as the most recently used entry; the least recently
used entries are closed (their KV cache freed) while the pool holds more than its budget. A
cancelled or failed generation closes its sequence instead (:meth:`~PromptCache.discard`): no
half-written entry is ever pooled.

An entry is taken only when the prompt keeps at least :data:`MIN_SHARED_FRACTION` of its tokens
(as llama.cpp's ``--slot-prompt-similarity``): two clients whose prompts share only the chat
template's first tokens do not take (and so overwrite) each other's history; such a request gets a
fresh sequence.

Each entry costs its whole KV cache (a sequence preallocates ``n_ctx`` positions), so the budget
bounds the number of entries: ``capacity_bytes // (n_ctx * kv_bytes_per_position)``.

Sequences that cannot rewind (:attr:`aioexperts.ModelSequence.rewinds` False: recurrent state,
as qwen35moe's linear attention) are taken only when all their tokens start the prompt and the
prompt is longer (the state after the last cached token is all they hold).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioexperts import Model, ModelSequence

__all__ = ("MIN_SHARED_FRACTION", "PromptCache", "default_capacity_bytes")

MIN_SHARED_FRACTION = 0.5
"""A pooled sequence is taken when the prompt keeps at least this fraction of its tokens."""


def default_capacity_bytes(available: int, sequence_bytes: int, parallel: int) -> int:
    """The pool's default budget: half the memory left once ``parallel`` running sequences have theirs.

    Args:
        available: bytes the process may still use (after the model started).
        sequence_bytes: one sequence's KV cache.
        parallel: sequences that run at once.

    Returns:
        Bytes (0 when nothing is left: the cache is off).
    """
    return max(0, (available - parallel * sequence_bytes) // 2)


class PromptCache:
    """Idle sequences with their KV caches, least recently used first.

    Args:
        model: the started model whose sequences are pooled.
        capacity_bytes: the pool's budget in bytes of KV cache (``>= 0``; 0 pools nothing).

    Attributes:
        hits: requests that took a pooled sequence.
        reused_tokens: prompt tokens those requests did not prefill again.
        evictions: entries closed to stay in the budget (or replaced by a longer one).
    """

    def __init__(self, model: Model, capacity_bytes: int) -> None:
        self.model = model
        self.capacity_bytes = capacity_bytes
        self.sequence_bytes = model.n_ctx * model.statistics().kv_bytes_per_position
        self._idle: OrderedDict[int, ModelSequence] = OrderedDict()  # id -> sequence, oldest first
        self.hits = 0
        self.reused_tokens = 0
        self.evictions = 0

    @property
    def entries(self) -> int:
        """Sequences in the pool."""
        return len(self._idle)

    @property
    def bytes(self) -> int:
        """KV cache bytes of the pooled sequences."""
        return len(self._idle) * self.sequence_bytes

    def _usable(self, seq: ModelSequence, ids: Sequence[int]) -> int:
        """Tokens of ``ids`` that ``seq`` would keep (0: not usable)."""
        shared = min(seq.shared_prefix(ids), len(ids) - 1)
        if not seq.rewinds and shared < seq.n_past:
            return 0
        return shared if shared >= MIN_SHARED_FRACTION * seq.n_past else 0

    def take(self, ids: Sequence[int]) -> tuple[ModelSequence, int]:
        """A sequence for the prompt ``ids``: the pooled one sharing the longest prefix (out of the
        pool now; at least :data:`MIN_SHARED_FRACTION` of its tokens), else a fresh one.

        Returns:
            ``(sequence, tokens it holds that start ids)``; the caller continues it with
            ``model.stream(ids, sequence=...)`` and hands it back with :meth:`put` or :meth:`discard`.

        Raises:
            StoreClosedError: the model is closed (from :meth:`aioexperts.Model.sequence`).
        """
        best: tuple[int, int] | None = None  # (kept tokens, key)
        for key, seq in self._idle.items():
            kept = self._usable(seq, ids)
            if kept > 0 and (best is None or kept >= best[0]):  # ties: the most recently used
                best = (kept, key)
        if best is None:
            return self.model.sequence(), 0
        seq = self._idle.pop(best[1])
        self.hits += 1
        self.reused_tokens += best[0]
        return seq, best[0]

    def put(self, seq: ModelSequence) -> None:
        """Pool a sequence whose generation ended normally (most recently used); evict beyond the budget.

        An entry whose tokens all start ``seq``'s is closed (``seq`` serves every prompt it would);
        a closed sequence, or one with tokens not run yet, is not pooled.
        """
        if seq.closed or seq.unrun or seq.n_past == 0 or self.sequence_bytes > self.capacity_bytes:
            seq.close()
            return
        for key, other in list(self._idle.items()):
            if other.rewinds and other.n_past <= seq.n_past and seq.tokens[: other.n_past] == other.tokens:
                del self._idle[key]
                other.close()
                self.evictions += 1
        self._idle[id(seq)] = seq
        while self.bytes > self.capacity_bytes:
            _, oldest = self._idle.popitem(last=False)
            oldest.close()
            self.evictions += 1

    @staticmethod
    def discard(seq: ModelSequence) -> None:
        """Close the sequence of a cancelled or failed generation (never pooled half-written)."""
        seq.close()

    def clear(self) -> None:
        """Close every pooled sequence (the server's shutdown)."""
        while self._idle:
            _, seq = self._idle.popitem()
            seq.close()
