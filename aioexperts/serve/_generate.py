"""One generation of the server: a prompt's ids through :meth:`aioexperts.Model.stream`, as :class:`Piece` s.

The sampler is :class:`aioexperts.Sampler` wrapped to keep every :class:`~aioexperts.SampledToken`
(its log-probabilities), so each piece of text comes with the tokens that made it; a
:class:`~aioexperts.TokenConstraint` (structured output) masks the logits first. Without a prompt
cache the sequence and its KV cache belong to the stream: they are freed when the generation ends,
fails or is cancelled. With one (:mod:`aioexperts.serve._prompt_cache`) the sequence comes from the
pool and goes back to it when the generation ends normally; a failed or cancelled one is closed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from aioexperts import (
    ExpertReadError,
    GenerationStatistics,
    InvalidRequestError,
    SampledToken,
    Sampler,
    SamplingOptions,
)

from ._errors import APIError
from ._openai import FINISH_REASONS, Piece, Usage

if TYPE_CHECKING:
    from aioexperts import Model, TextStream, TokenConstraint

    from ._health import Health
    from ._prompt_cache import PromptCache

__all__ = ("Generation", "SamplerFactory")


SamplerFactory = Callable[[SamplingOptions], Callable[[np.ndarray, Sequence[int]], "int | SampledToken"]]
"""Makes the sampler of one generation from its options: ``(logits, history) -> token id`` (or a
:class:`SampledToken`); ``ServerOptions.sampler_factory``."""


class _Recorder:
    """``(logits, history) -> id`` through a :class:`Sampler` (or a factory's sampler), keeping each
    :class:`SampledToken`."""

    def __init__(
        self,
        options: SamplingOptions,
        constraint: TokenConstraint | None = None,
        factory: SamplerFactory | None = None,
        constraint_param: str = "grammar",
    ) -> None:
        self._sampler = Sampler(options) if factory is None else None
        self._custom = factory(options) if factory is not None else None
        self._constraint = constraint
        self._constraint_param = constraint_param
        self.sampled: list[SampledToken] = []

    def _sample(self, logits: np.ndarray, history: Sequence[int]) -> SampledToken:
        if self._custom is not None:
            got = self._custom(logits, history)
            return got if isinstance(got, SampledToken) else SampledToken(int(got))
        assert self._sampler is not None
        return self._sampler.sample(logits, history)

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        if self._constraint is None:
            chosen = self._sample(logits, history)
        else:
            tried: list[SampledToken] = []

            def pick(masked: np.ndarray) -> int:
                tried.append(self._sample(masked, history))
                return tried[-1].token

            try:
                token = self._constraint.choose(logits, pick)
            except InvalidRequestError as exc:  # the grammar failed (an llguidance limit) or allows nothing
                param = self._constraint_param
                raise APIError(400, f"'{param}': {exc}", param=param, code="invalid_schema") from None
            chosen = tried[-1] if tried and tried[-1].token == token else SampledToken(token)
        self.sampled.append(chosen)
        return chosen.token


class Generation:
    """The continuation of ``prompt_ids``.

    Args:
        model: the started model.
        prompt_ids: the prompt's token ids (checked against ``n_ctx`` by the caller).
        options: sampling options (``max_tokens`` is replaced by ``max_tokens``).
        max_tokens: tokens to generate at most.
        top_logprobs: ``None``: no log-probabilities; else the alternatives to report per token.
        on_token: called once per generated token (the server's counters).
        cache: the prompt cache to take the sequence from and give it back to (None: a fresh one).
        constraint: the grammar the generated tokens must follow (None: free text).
        constraint_param: the request field the grammar came from (named when it fails: 400
            ``invalid_schema``).
        sampler_factory: makes the sampler instead of :class:`aioexperts.Sampler` (tests; None: the default).
        health: told of a generation that failed on an expert read and of one that ended normally
            (``GET /health``; None: nobody is told).
    """

    def __init__(
        self,
        model: Model,
        prompt_ids: Sequence[int],
        options: SamplingOptions,
        max_tokens: int,
        top_logprobs: int | None,
        on_token: Callable[[], None],
        cache: PromptCache | None = None,
        constraint: TokenConstraint | None = None,
        sampler_factory: SamplerFactory | None = None,
        health: Health | None = None,
        constraint_param: str = "grammar",
    ) -> None:
        n_logprobs = 0 if top_logprobs is None else max(1, top_logprobs)
        self._options = replace(options, max_tokens=max_tokens, logprobs=n_logprobs)
        self._model = model
        self._prompt_ids = list(prompt_ids)
        self._on_token = on_token
        self._cache = cache
        self._constraint = constraint
        self._constraint_param = constraint_param
        self._sampler_factory = sampler_factory
        self._health = health
        self.statistics = GenerationStatistics()

    @property
    def finish_reason(self) -> str:
        """OpenAI's ``finish_reason``: ``"stop"`` (end-of-generation token or stop string) or ``"length"``."""
        return FINISH_REASONS.get(self.statistics.stop_reason or "", "stop")

    @property
    def usage(self) -> Usage:
        """Prompt and generated tokens so far."""
        stats = self.statistics
        return Usage(len(self._prompt_ids), stats.generated_tokens, stats.reused_tokens)

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The pieces of text as they are decoded (the first ``await`` starts the prefill).

        Raises:
            As :meth:`aioexperts.Model.stream` (InvalidRequestError, NonFiniteError, store errors).
        """
        recorder = _Recorder(self._options, self._constraint, self._sampler_factory, self._constraint_param)
        if self._cache is None:
            stream = self._model.stream(self._prompt_ids, options=self._options, sampler=recorder)
            async with aclosing(self._pieces(stream, recorder)) as pieces:
                async for piece in pieces:
                    yield piece
            return
        seq, _ = self._cache.take(self._prompt_ids)
        try:
            stream = self._model.stream(self._prompt_ids, options=self._options, sampler=recorder, sequence=seq)
            async with aclosing(self._pieces(stream, recorder)) as pieces:
                async for piece in pieces:
                    yield piece
        except BaseException:
            self._cache.discard(seq)
            raise
        if self.statistics.stop_reason in FINISH_REASONS:  # ended normally: back to the pool
            self._cache.put(seq)
        else:
            self._cache.discard(seq)

    async def _pieces(self, stream: TextStream, recorder: _Recorder) -> AsyncGenerator[Piece, None]:
        seen = 0
        try:
            async with stream:
                async for text in stream:
                    now = len(stream.token_ids)
                    for _ in range(now - seen):
                        self._on_token()
                    yield Piece(text, recorder.sampled[seen:now])
                    seen = now
                for _ in range(len(stream.token_ids) - seen):  # tokens of a stop string
                    self._on_token()
        except ExpertReadError as exc:
            if self._health is not None:
                self._health.failed(exc)
            raise
        else:
            if self._health is not None:
                self._health.succeeded()
        finally:
            self.statistics = stream.statistics
