"""Sequences of a :class:`~aioexperts.Model` and the one decode loop under every generation.

A :class:`ModelSequence` owns one KV cache and runs its tokens through the model's forward pass
(:mod:`aioexperts._model.forward`); :func:`decode_tokens` is the loop every generation runs
(:class:`Generation` of token ids, and the token and text streams and chat turns of
:mod:`aioexperts._model.text`): prefill in batches of :data:`PREFILL_BATCH`, then one token at a
time until an end-of-generation id, ``max_tokens`` or a full KV cache.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import anyio
import numpy as np

from aioexperts._errors import ContextLengthError, InvalidRequestError
from aioexperts._format.architectures import ModelHParams
from aioexperts._model.forward import ForwardCounters, ForwardPass, Rows
from aioexperts._model.kvcache import KVCache

__all__ = (
    "PREFILL_BATCH",
    "Generation",
    "GenerationStatistics",
    "ModelSequence",
    "Sampler",
    "SequenceModel",
    "decode_tokens",
)

PREFILL_BATCH = 512
"""Prompt tokens run in one forward batch (llama.cpp's default ``n_ubatch``)."""

#: ``sampler(logits, history) -> token id``: ``logits`` is ``(n_vocab,)`` float32, ``history`` the
#: sequence's tokens so far (prompt and generated).
Sampler = Callable[[np.ndarray, Sequence[int]], int]


class SequenceModel(Protocol):
    """What a sequence needs of its model (:class:`~aioexperts.Model`)."""

    _counters: ForwardCounters

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_vocab(self) -> int: ...

    @property
    def hparams(self) -> ModelHParams: ...

    @property
    def forward_pass(self) -> ForwardPass: ...

    def _check_ids(self, token_ids: Sequence[int], *, allow_empty: bool = False) -> list[int]: ...

    def _sequence_closed(self, seq: ModelSequence) -> None: ...

    def _forget(self, seq: ModelSequence) -> None: ...


@dataclass(frozen=True, slots=True)
class GenerationStatistics:
    """What one generation (or chat turn) did, and how fast.

    Attributes:
        prompt_tokens: tokens of the prompt (for a chat turn: the whole rendered conversation).
        reused_tokens: prompt tokens already in the KV cache and kept (chat sessions; else 0).
        prefilled_tokens: prompt tokens run by this call (``prompt_tokens - reused_tokens`` once the
            prompt has run; a call cancelled or failed during its prefill counts the batches of
            :data:`PREFILL_BATCH` tokens that ran).
        generated_tokens: tokens yielded (end-of-generation ids and a stop string's tokens included
            in the count only when yielded; an EOG id is never yielded).
        prefill_seconds: wall time from the start of the call to the first sampled token.
        decode_seconds: wall time of the later tokens (forward pass and sampling).
        time_to_first_token: seconds from the call to the first token (or text piece) handed out;
            None when none was.
        stop_reason: ``"eog"`` (an end-of-generation id), ``"length"`` (``max_tokens``, or the KV
            cache full: prompt plus generated tokens reach ``n_ctx``), ``"stop"`` (a stop string),
            ``"cancelled"``, ``"error"``; None while running.
        stop_string: the stop string that ended it, else None.
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    time_to_first_token: float | None = None
    stop_reason: str | None = None
    stop_string: str | None = None

    @property
    def prompt_tokens_per_second(self) -> float | None:
        """Prefilled tokens per second of prefill (None before the first token)."""
        if self.prefill_seconds <= 0 or self.prefilled_tokens == 0:
            return None
        return self.prefilled_tokens / self.prefill_seconds

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first per second of decode (None with fewer than two tokens)."""
        if self.decode_seconds <= 0 or self.generated_tokens < 2:
            return None
        return (self.generated_tokens - 1) / self.decode_seconds


class ModelSequence:
    """One sequence with its own preallocated KV cache (from :meth:`Model.sequence`).

    The cache keeps the positions already run (:attr:`n_past`) between calls; :meth:`keep` drops
    all but a prefix (a chat reusing a shared prefix). Use it as an async context manager or call
    :meth:`close` to free the cache. Calls on one sequence run one at a time.

    Attributes:
        model: the model.
        tokens: the token ids of positions ``0..n_past-1`` (in the KV cache).
        unrun: tokens a :meth:`generate` yielded last that are not in the cache yet; the next
            :meth:`forward` or :meth:`generate` runs them first.
    """

    def __init__(self, model: SequenceModel, cache: KVCache) -> None:
        self.model = model
        self._cache: KVCache | None = cache
        self.tokens: list[int] = []
        self.unrun: list[int] = []
        self._last_logits: np.ndarray | None = None  # of position n_past - 1
        self._lock = anyio.Lock()
        self._paused: Generation | None = None  # suspended after a yield (its token not run yet)

    def _end_paused(self) -> None:
        """A generation of this sequence left after a yield without being closed (``break`` out of
        ``async for``): it ends here, its last token going to :attr:`unrun`, so this call continues
        after what the caller saw."""
        gen, self._paused = self._paused, None
        if gen is not None:
            gen._abandon()

    @property
    def n_past(self) -> int:
        """Positions already in the KV cache."""
        return len(self.tokens)

    @property
    def n_ctx(self) -> int:
        """Positions the KV cache holds."""
        return self.model.n_ctx

    def shared_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the KV cache already holds (``tokens``' common prefix with them)."""
        tokens = self.tokens
        n = min(len(tokens), len(token_ids))
        i = 0
        while i < n and tokens[i] == token_ids[i]:
            i += 1
        return i

    @property
    def rewinds(self) -> bool:
        """Whether :meth:`keep` of a shorter prefix reuses the kept positions (False for a model with
        recurrent blocks, whose state cannot go back: the next call runs the kept tokens again)."""
        return self._cache is None or not self._cache.recurrent

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._cache is None

    @property
    def busy(self) -> bool:
        """True while a call on this sequence runs (a :meth:`forward`, a generation's step)."""
        return self._lock.locked()

    def keep(self, n: int) -> None:
        """Keep only the first ``n`` positions (``0 <= n <= n_past``); later calls continue from there.

        A model with recurrent blocks (qwen35moe's gated delta net) cannot rewind their state: after
        ``keep(n)`` with ``n < n_past`` the next :meth:`forward` runs the kept ``n`` tokens again from
        position 0 before its own (a re-prefill: the same numbers as a fresh sequence, not a reuse).

        Raises:
            InvalidRequestError: ``n`` out of range, the sequence is closed, or a call on it is
                running (a :meth:`forward`, a step of a generation: await it first; cutting the
                tokens under it would leave them unlike what its cache holds).
        """
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.n_past:
            raise InvalidRequestError(f"keep(n) needs 0 <= n <= n_past={self.n_past}, got {n!r}")
        if self._cache is None:
            raise InvalidRequestError("the sequence is closed")
        if self._lock.locked():
            raise InvalidRequestError(
                "keep() while a call on this sequence is running: calls on one sequence run one at a time, "
                "await it first"
            )
        self._end_paused()
        if n < self.n_past:
            self.unrun.clear()
            self._last_logits = None
        del self.tokens[n:]

    def close(self) -> None:
        """Free the KV cache (idempotent)."""
        if self._cache is not None:
            self._cache.free()
            self._cache = None
            self.model._sequence_closed(self)
            self.model._forget(self)

    async def __aenter__(self) -> ModelSequence:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    async def forward(
        self, token_ids: Sequence[int], *, all_logits: bool = True, capture: dict[str, np.ndarray] | None = None
    ) -> np.ndarray:
        """Run ``token_ids`` at the next positions (one batch), add them to the cache, return logits.

        Tokens in :attr:`unrun` run first (their logits are not returned).

        Args:
            token_ids: ids in ``0..n_vocab-1`` (one at least, unless :attr:`unrun` has some).
            all_logits: logits of every new position; False: of the last one only.
            capture: a dict that receives the pass's named intermediate tensors, float32 with one
                row per position run, named as llama.cpp's graph names them (``attn_norm-L``,
                ``ffn_inp-L``, ``topk-L`` (int32), ``l_out-L``, ``result_norm``) for comparing with
                llama.cpp's eval callback; the pass then never joins a batched decode step.

        Returns:
            float32 ``(len(token_ids), n_vocab)`` (``(1, n_vocab)`` when not ``all_logits``).

        Raises:
            InvalidRequestError: empty input, an id out of range or not an int, the sequence closed.
            ContextLengthError: ``n_past + len(token_ids) > n_ctx``.
            NonFiniteError: NaN or inf in the residual stream or the logits.
            StoreClosedError, ExpertReadError, SlabExhaustedError: from the expert store.

        Cancellation handling:
            The positions of a cancelled call are not added (``n_past`` is unchanged); the
            sequence stays usable.
        """
        self._end_paused()
        ids = self.model._check_ids(token_ids, allow_empty=bool(self.unrun))
        async with self._lock:
            if self._cache is None:
                raise InvalidRequestError("the sequence is closed")
            run = self.unrun + ids
            cache, start = self._cache, self.n_past
            if cache.recurrent and cache.state_positions != start:
                # a recurrent state holds other positions than the kept ones (keep() of a shorter
                # prefix, a cancelled or failed call): run the kept tokens again from position 0
                run, start = self.tokens + run, 0
            if start + len(run) > self.n_ctx:
                raise ContextLengthError(
                    f"{len(run) - self.n_past + start} new tokens after {self.n_past} would pass "
                    f"n_ctx={self.n_ctx} positions (load the model with a larger n_ctx, or --ctx of "
                    "aioexperts-run and aioexperts-serve; or keep() a shorter prefix)"
                )
            assert cache.layers is not None
            if capture is not None and not isinstance(capture, dict):
                raise InvalidRequestError(f"capture must be a dict or None, got {type(capture).__name__}")
            rows = Rows(cache.layers, start, run, all_logits=all_logits or not ids, capture=capture)
            cache.state_positions = -1  # unknown until this call finishes
            logits = await self.model.forward_pass(rows, step_of=self)
            del self.tokens[start:]
            self.tokens.extend(run)
            cache.state_positions = self.n_past
            self.unrun = []
            self._last_logits = logits[-1].copy()
            if not all_logits:
                return logits[-1:]
            return logits[len(run) - len(ids) :] if ids else logits[-1:]

    def generate(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        sampler: Sampler | None = None,
        seed: int | None = None,
    ) -> Generation:
        """Feed ``token_ids`` (may be empty when ``n_past > 0``), then yield new tokens one at a time.

        Greedy (the first largest logit) at ``temperature == 0`` without a sampler; at
        ``temperature > 0`` without a sampler, a draw from ``softmax(logits / temperature)`` with a
        ``numpy`` generator seeded by ``seed``. Stops after ``max_tokens`` tokens, at an
        end-of-generation id (``tokenizer.ggml.eos/eot/eom_token_id``), which is not yielded, or
        when the KV cache is full: the tokens in the cache, in :attr:`unrun` and yielded take at
        most :attr:`n_ctx` positions (``stop_reason == "length"``). The last yielded token is kept
        in :attr:`unrun`, not run yet: the next :meth:`forward` or ``generate([])`` runs it first.

        Returns:
            A :class:`Generation` (``async for token in ...``; also an async context manager).

        Raises:
            InvalidRequestError: bad arguments or ids, a ``seed`` outside ``[0, 2**64 - 1]``, the
                sequence closed (here); a sampler returning something that is not a token id
                (while iterating).
            ContextLengthError: while iterating, when the prompt would pass ``n_ctx``.
            As :meth:`forward`, while iterating.
        """
        self._end_paused()
        return Generation(self, token_ids, max_tokens, temperature, sampler, seed, owns_sequence=False)


class Generation:
    """New token ids, one per ``await anext()`` (from :meth:`Model.generate` / :meth:`ModelSequence.generate`).

    An async iterator of ``int``; as an async context manager (or with :meth:`aclose`) it ends
    early. A generation made by :meth:`Model.generate` owns its sequence and frees the KV cache
    when it ends: exhausted, failed, cancelled inside a step, closed, or dropped.

    It stops at an end-of-generation id, after ``max_tokens`` tokens, or when every position of
    the KV cache is taken (prompt plus yielded tokens reach ``n_ctx``, as the server's
    ``max_tokens = n_ctx - prompt``): the last yielded token still has its position.

    Attributes:
        stop_reason: ``"eog"`` (an end-of-generation id), ``"length"`` (``max_tokens``, or the KV
            cache full); None while running or when it ended otherwise (closed, failed).
    """

    def __init__(
        self,
        seq: ModelSequence,
        token_ids: Sequence[int],
        max_tokens: int,
        temperature: float,
        sampler: Sampler | None,
        seed: int | None,
        *,
        owns_sequence: bool,
    ) -> None:
        self._seq: ModelSequence | None = None
        self._owns = False
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature < np.inf:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if sampler is not None and not callable(sampler):
            raise InvalidRequestError(f"sampler must be a callable (logits, history) -> int, got {sampler!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
            raise InvalidRequestError(f"seed must be an int in [0, 2**64 - 1] or None, got {seed!r}")
        if seq.closed:  # before anything is yielded (the old logits would give a token)
            raise InvalidRequestError("the sequence is closed")
        pending = seq.model._check_ids(token_ids, allow_empty=True)
        if not pending and seq.n_past == 0 and not seq.unrun:
            raise InvalidRequestError("generate needs at least one token id")
        self._seq = seq
        self._owns = owns_sequence
        self._pending = pending
        self._left = max_tokens
        self._temperature = float(temperature)
        self._sampler = sampler
        self._rng = np.random.default_rng(seed)
        self._stats = [GenerationStatistics()]
        self._leftover: list[int] = []
        self._last: int | None = None  # the last token yielded
        self._tokens: AsyncGenerator[int, None] | None = None
        self._stepping = False  # an __anext__ is running
        self.stop_reason: str | None = None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> int:
        if self._stepping:  # a second consumer: its error must not end the first one's step
            raise InvalidRequestError("this generation is being iterated by another task: one consumer at a time")
        self._stepping = True
        try:
            return await self._next()
        finally:
            self._stepping = False

    async def _next(self) -> int:
        seq = self._seq
        if seq is None:
            raise StopAsyncIteration
        if seq._paused is self:
            seq._paused = None
        if self._tokens is None:
            eog = frozenset(seq.model.hparams.eog_ids)
            self._tokens = decode_tokens(
                seq, self._pending, self._choose, self._left, eog, self._stats, time.perf_counter(), self._leftover
            )
        try:
            token = await self._tokens.__anext__()
        except StopAsyncIteration:
            self.stop_reason = self._stats[0].stop_reason
            if not self._owns:  # not run yet: the sequence's next call runs them first
                seq.unrun.extend(self._leftover)
            self._finish()
            raise
        except BaseException:  # cancelled or failed in a step
            self._keep_yielded()
            self._finish()
            raise
        self._last = token
        if not self._owns:
            seq._paused = self
        return token

    def _abandon(self) -> None:
        """Ended by its sequence's next call while suspended after a yield (never closed)."""
        self._keep_yielded()
        tokens, self._tokens = self._tokens, None
        if tokens is not None:  # suspended at its yield, with nothing to await on the way out
            closing = tokens.aclose()
            try:
                closing.send(None)
            except StopIteration:
                pass
            else:  # pragma: no cover - decode_tokens awaits nothing when closed
                closing.close()
        self._finish()

    def _keep_yielded(self) -> None:
        """On an early end (closed, cancelled, failed): the last yielded token, when it is not in
        the cache yet, goes to the sequence's :attr:`~ModelSequence.unrun` (a sequence the caller
        keeps), as at a normal end: the caller has seen it, so the next call must not sample that
        position again. Tokens of the prompt that did not run are dropped, as before."""
        seq = self._seq
        if seq is not None and not self._owns and self._last is not None and self._leftover == [self._last]:
            seq.unrun.append(self._last)
        self._leftover.clear()

    def _choose(self, logits: np.ndarray, history: Sequence[int]) -> int:
        if self._sampler is not None:
            return self._sampler(logits, history)
        if self._temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self._temperature
        pr = np.exp(z - z.max())
        return int(self._rng.choice(len(pr), p=pr / pr.sum()))

    def _finish(self) -> None:
        seq, self._seq = self._seq, None
        if seq is not None and seq._paused is self:
            seq._paused = None
        if seq is not None and self._owns:
            seq.close()

    async def aclose(self) -> None:
        """End the generation now (frees the KV cache of a generation that owns its sequence); on
        a sequence the caller keeps, the last yielded token is left in its ``unrun``, as at the end
        of ``max_tokens``."""
        tokens, self._tokens = self._tokens, None
        if tokens is not None:
            await tokens.aclose()
        self._keep_yielded()
        self._finish()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self._finish()


async def decode_tokens(
    seq: ModelSequence,
    pending: list[int],
    choose: Sampler,
    max_tokens: int,
    eog: frozenset[int],
    stats: list[GenerationStatistics],
    started: float,
    leftover: list[int],
) -> AsyncGenerator[int, None]:
    """The one decode loop (under :meth:`ModelSequence.generate`, :meth:`Model.generate`,
    :meth:`Model.stream` and the chat turns): prefill ``pending`` at ``seq.n_past`` in batches of
    :data:`PREFILL_BATCH`, then yield ``choose(logits, history)`` one token at a time.

    It stops at an end-of-generation id in ``eog`` (not yielded), after ``max_tokens`` tokens, or
    when every position of the KV cache is taken (the tokens in the cache, in ``seq.unrun`` and
    yielded reach ``n_ctx``); ``stats[0]`` is updated as it goes (``stop_reason`` ``"eog"`` or
    ``"length"`` at the end). The last yielded token (or the tokens not run when the cache is full)
    is not run: it is left in ``leftover``. With nothing to run and ``seq``'s last logits at hand,
    those are used; without them the last cached position is run again.

    Raises:
        InvalidRequestError: ``choose`` returned something that is not a token id.
        ContextLengthError: ``pending`` does not fit the KV cache.
        As :meth:`ModelSequence.forward`.
    """
    model = seq.model
    n_vocab = model.n_vocab
    t_last = started
    for n in range(max_tokens):
        leftover[:] = pending
        if seq.n_past + len(seq.unrun) + len(pending) == seq.n_ctx:
            # every position is taken once these run: a new token would have none (more than
            # n_ctx: the forward refuses the prompt with ContextLengthError)
            stats[0] = replace(stats[0], stop_reason="length")
            return
        if not pending and not seq.unrun and seq._last_logits is not None:
            logits = seq._last_logits  # the last forward's, at the last cached position
            seq._last_logits = None
        else:
            if not pending and not seq.unrun:  # logits of the last cached position: run it again
                pending = [seq.tokens[-1]]
                seq.keep(seq.n_past - 1)
            while len(pending) > PREFILL_BATCH:
                await seq.forward(pending[:PREFILL_BATCH], all_logits=False)
                pending = pending[PREFILL_BATCH:]
                leftover[:] = pending
                stats[0] = replace(stats[0], prefilled_tokens=stats[0].prefilled_tokens + PREFILL_BATCH)
            logits = (await seq.forward(pending, all_logits=False))[0]
            if n == 0:  # the prompt's last batch has run
                stats[0] = replace(stats[0], prefilled_tokens=stats[0].prefilled_tokens + len(pending))
        leftover.clear()
        t0 = time.perf_counter()
        token = choose(logits, tuple(seq.tokens))
        if isinstance(token, np.integer):
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < n_vocab:
            raise InvalidRequestError(f"the sampler returned {token!r}, not a token id in 0..{n_vocab - 1}")
        now = time.perf_counter()
        model._counters.sampling_seconds += now - t0
        s = stats[0]
        if n == 0:
            s = replace(s, prefill_seconds=now - started)
        else:
            s = replace(s, decode_seconds=s.decode_seconds + (now - t_last))
        t_last = now
        if token in eog:
            stats[0] = replace(s, stop_reason="eog")
            return
        stats[0] = replace(s, generated_tokens=s.generated_tokens + 1)
        leftover[:] = [token]  # not run: where an early end (close, cancel) finds it
        yield token
        pending = [token]
    leftover[:] = pending if max_tokens else []
    stats[0] = replace(stats[0], stop_reason="length")
