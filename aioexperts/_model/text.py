"""Text in, text out on top of :class:`~aioexperts._model.model.Model`: prompts, streaming, chat sessions.

The forward pass knows only token ids; this module adds the tokenizer (built lazily from the model
file on first text use, so a model used only with ids needs no ``text`` extra), the sampler and stop
strings of :mod:`aioexperts._text.sampling`, and a chat session that keeps its KV cache between turns
and prefills only what follows the prefix it already holds (as llama.cpp's server does with
``cache_prompt``).

Every generation runs the one decode loop (:func:`~aioexperts._model.sessions.decode_tokens`):
prefill the new prompt tokens in batches of :data:`PREFILL_BATCH`, then one token at a time;
it stops at an end-of-generation id (not
yielded), after ``max_tokens``, at a stop string (:meth:`Model.stream` only) or when the KV cache is
full: prompt plus generated tokens reach ``n_ctx`` (``stop_reason == "length"``, as the server's
``finish_reason``; the text is never truncated, a prompt that does not fit is refused up front with
:class:`~aioexperts.ContextLengthError`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import anyio
import numpy as np

from aioexperts._errors import ConfigError, ContextLengthError, InvalidRequestError
from aioexperts._model.sessions import (
    PREFILL_BATCH,
    GenerationStatistics,
    ModelSequence,
    Sampler,
    SequenceModel,
    decode_tokens,
)

if TYPE_CHECKING:
    from aioexperts._text.chat import ChatTemplate
    from aioexperts._text.sampling import SamplingOptions
    from aioexperts._text.tokenizer import Tokenizer

__all__ = (
    "DEFAULT_MAX_TOKENS",
    "PREFILL_BATCH",
    "ChatSession",
    "GenerationStatistics",
    "TextStream",
    "TokenStream",
    "check_fits",
    "chat_prompt_ids",
    "open_run",
)

DEFAULT_MAX_TOKENS = 256
"""``max_tokens`` when none is given (``SamplingOptions``' default)."""

#: Greedy unless told otherwise (as ``Model.generate`` always was); the other fields are llama.cpp's.
_GREEDY = {"temperature": 0.0}

T = TypeVar("T")


class TextModel(SequenceModel, Protocol):
    """What the text layer needs of its model (:class:`~aioexperts.Model`)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    def sequence(self) -> ModelSequence: ...

    def _started(self) -> object: ...


class _Run(Generic[T]):
    """An async iterator over an async generator, with live statistics and ``aclose``."""

    def __init__(self, stats: list[GenerationStatistics]) -> None:
        self._stats = stats
        self._agen: AsyncGenerator[T, None] | None = None

    @property
    def statistics(self) -> GenerationStatistics:
        """The statistics so far (final once the iteration ended)."""
        return self._stats[0]

    def __aiter__(self) -> _Run[T]:
        return self

    async def __anext__(self) -> T:
        assert self._agen is not None
        if getattr(self._agen, "ag_running", False):  # asend's own RuntimeError names no cause
            raise InvalidRequestError("this generation is being iterated by another task: one consumer at a time")
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        """Stop the generation and free what it holds (idempotent)."""
        assert self._agen is not None
        await self._agen.aclose()

    async def __aenter__(self) -> _Run[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class TokenStream(_Run[int]):
    """Token ids as they are sampled (from :meth:`Model.generate` with a text prompt or sampling options).

    ``statistics`` gives a :class:`GenerationStatistics` (live, final at the end). Leaving the loop
    early frees the sequence when the iterator is closed: use ``async with model.generate(...) as
    gen:`` or call ``await gen.aclose()``.
    """


class TextStream(_Run[str]):
    """Text pieces as they are decoded (from :meth:`Model.stream` and :meth:`ChatSession.send`).

    The concatenated pieces equal ``tokenizer.decode`` of the generated ids (no piece ends inside a
    UTF-8 character), minus a stop string and whatever followed it. ``statistics`` as for
    :class:`TokenStream`; ``token_ids`` holds the ids generated so far.
    """

    def __init__(self, stats: list[GenerationStatistics]) -> None:
        super().__init__(stats)
        self.token_ids: list[int] = []


# -- prompts and options -----------------------------------------------------------------------------


def _options(
    options: SamplingOptions | None,
    fields: Mapping[str, Any],
) -> SamplingOptions:
    from aioexperts._text.sampling import SamplingOptions

    given = {k: v for k, v in fields.items() if v is not None}
    if options is not None:
        if not isinstance(options, SamplingOptions):
            raise ConfigError(f"options must be a SamplingOptions, got {type(options).__name__}")
        if given:
            raise ConfigError(f"pass either options=SamplingOptions(...) or {', '.join(sorted(given))}, not both")
        return options
    if "stop" in given:
        stop = given["stop"]
        if not isinstance(stop, str) and not (isinstance(stop, Iterable) and not isinstance(stop, bytes)):
            raise ConfigError(f"stop must be a string or a sequence of strings, got {stop!r:.80}")
        given["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    return SamplingOptions(**{**_GREEDY, **given})


def _prompt_ids(model: TextModel, prompt: str | Sequence[int], *, add_special: bool, parse_special: bool) -> list[int]:
    """Token ids of ``prompt`` (checked against the model's vocabulary and ``n_ctx``)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty: there is nothing to continue")
        ids = model.tokenizer.encode(prompt, add_special=add_special, parse_special=parse_special)
    elif isinstance(prompt, bytes):
        raise InvalidRequestError("the prompt must be a str or a sequence of token ids, not bytes")
    elif not isinstance(prompt, Iterable):  # list(123) would be a bare TypeError
        raise InvalidRequestError(
            f"the prompt must be a str or a sequence of token ids (ints), got {type(prompt).__name__} {prompt!r:.50}"
        )
    else:
        ids = list(prompt) if not isinstance(prompt, np.ndarray) else prompt.tolist()
    ids = model._check_ids(ids)
    check_fits(model, len(ids))
    return ids


def check_fits(model: TextModel, n_prompt: int) -> None:
    if n_prompt > model.n_ctx:
        raise ContextLengthError(
            f"the prompt is {n_prompt} tokens, more than n_ctx={model.n_ctx} positions: it is not truncated "
            "(load the model with a larger n_ctx, or --ctx of aioexperts-run and aioexperts-serve; "
            "or shorten the prompt)"
        )


def _eog_ids(model: TextModel, with_tokenizer: bool) -> frozenset[int]:
    """The file's EOG ids, plus the tokenizer's (llama.cpp also detects ``<|im_end|>`` & co. by text)."""
    eog = frozenset(model.hparams.eog_ids)
    if with_tokenizer:
        eog |= model.tokenizer.eog_ids
    return eog


def _make_sampler(options: SamplingOptions, sampler: Sampler | None) -> Any:
    from aioexperts._text.sampling import Sampler as ChainSampler

    if sampler is not None:
        if not callable(sampler):
            raise ConfigError(f"sampler must be a callable (logits, history) -> int, got {sampler!r}")
        return sampler
    return ChainSampler(options)


def _first_token(stats: list[GenerationStatistics], started: float) -> None:
    if stats[0].time_to_first_token is None:
        stats[0] = replace(stats[0], time_to_first_token=time.perf_counter() - started)


def _ended(stats: list[GenerationStatistics], exc: BaseException | None) -> None:
    if stats[0].stop_reason is None:
        cancelled = exc is None or isinstance(exc, GeneratorExit | asyncio.CancelledError)
        if not cancelled:
            try:
                cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
            except (RuntimeError, LookupError):  # no async library running (finalized outside a loop)
                pass
        stats[0] = replace(stats[0], stop_reason="cancelled" if cancelled else "error")


async def _generate(
    model: TextModel,
    seq: ModelSequence | None,
    reused: int,
    prompt: list[int],
    options: SamplingOptions,
    sampler: Any,
    eog: frozenset[int],
    stats: list[GenerationStatistics],
    owns_sequence: bool,
    text: TextStream | None,
) -> AsyncGenerator[Any, None]:
    """The one generation under ``generate``, ``stream`` and the chat turns: token ids, or with
    ``text`` the text pieces (no piece ends inside a UTF-8 character; a stop string is not
    emitted). ``seq=None``: a fresh sequence, made when iteration starts and closed when it ends."""
    from aioexperts._text.sampling import StopMatcher

    started = time.perf_counter()
    stats[0] = GenerationStatistics(len(prompt), reused, 0)  # prefilled_tokens: counted as batches run
    stopper = StopMatcher(options.stop) if options.stop else None
    decoder = model.tokenizer.decoder() if text is not None or stopper is not None else None
    if seq is None:
        seq = model.sequence()
    try:
        tokens_of = decode_tokens(seq, prompt[reused:], sampler, options.max_tokens, eog, stats, started, [])
        async with aclosing(tokens_of) as tokens:
            async for token in tokens:
                if text is None:  # ids: each token as it comes, the stop string's last one too
                    _first_token(stats, started)
                    yield token
                    if stopper is not None and decoder is not None:
                        stopper.feed(decoder.feed(token))
                else:
                    assert decoder is not None
                    text.token_ids.append(token)
                    piece = decoder.feed(token)
                    if stopper is not None:
                        piece = stopper.feed(piece)
                    if piece:
                        _first_token(stats, started)
                        yield piece
                if stopper is not None and stopper.stopped:
                    stats[0] = replace(stats[0], stop_reason="stop", stop_string=stopper.stop_string)
                    return
        if text is not None:
            assert decoder is not None
            tail = decoder.flush()
            if stopper is not None:
                tail = stopper.feed(tail)
                if stopper.stopped:
                    stats[0] = replace(stats[0], stop_reason="stop", stop_string=stopper.stop_string)
                else:
                    tail += stopper.flush()
            if tail:
                _first_token(stats, started)
                yield tail
    except BaseException as exc:
        _ended(stats, exc)
        raise
    finally:
        _ended(stats, None)
        if owns_sequence:
            seq.close()
        else:  # kept (a chat session, a prompt cache): no decode step waits for it to come back
            model._forget(seq)


def _prepare(
    model: TextModel,
    prompt: str | Sequence[int],
    options: SamplingOptions | None,
    sampler: Sampler | None,
    add_special: bool,
    parse_special: bool,
    sampling: Mapping[str, Any],
) -> tuple[SamplingOptions, list[int], Any]:
    """The checked options, the prompt's ids and the sampler of a generation or a stream."""
    opts = _options(options, sampling)
    ids = _prompt_ids(model, prompt, add_special=add_special, parse_special=parse_special)
    return opts, ids, _make_sampler(opts, sampler)


def open_run(
    model: TextModel,
    prompt: str | Sequence[int],
    *,
    options: SamplingOptions | None,
    sampler: Sampler | None,
    add_special: bool,
    parse_special: bool,
    sampling: Mapping[str, Any],
    as_text: bool,
    sequence: ModelSequence | None = None,
) -> TokenStream | TextStream:
    """:meth:`Model.generate`'s (token ids) and :meth:`Model.stream`'s (``as_text``: text pieces)
    body: a generation of ``prompt`` on a fresh sequence, or on ``sequence`` after keeping the
    longest prefix of ``prompt`` it holds (:func:`keep_prefix`); its arguments checked here, before
    the first ``await``."""
    opts, ids, smp = _prepare(model, prompt, options, sampler, add_special, parse_special, sampling)
    reused = 0 if sequence is None else keep_prefix(model, sequence, ids)
    eog = _eog_ids(model, as_text or isinstance(prompt, str) or bool(opts.stop))
    stats = [GenerationStatistics()]
    out: TokenStream | TextStream = TextStream(stats) if as_text else TokenStream(stats)
    model._started()  # StoreClosedError now, not at the first token
    text = out if isinstance(out, TextStream) else None
    out._agen = _generate(model, sequence, reused, ids, opts, smp, eog, stats, sequence is None, text)
    return out


def keep_prefix(model: TextModel, seq: ModelSequence, ids: list[int], *, restart: bool = False) -> int:
    """Keep the longest prefix of ``ids`` that ``seq`` holds (at least one token is left to run, for
    the logits); returns the tokens kept.

    A sequence that cannot rewind (``seq.rewinds`` False: recurrent state) is only continued when
    all it holds is a prefix of ``ids``, shorter than ``ids``; otherwise, with ``restart``, it keeps
    nothing (the whole prompt is prefilled again, as a chat turn does).

    Raises:
        InvalidRequestError: ``seq`` is closed, of another model, busy (a call on it running),
            has tokens not run yet (``unrun``), or cannot rewind to the common prefix (without ``restart``).
    """
    if not isinstance(seq, ModelSequence) or seq.closed or seq.model is not model:
        raise InvalidRequestError(f"sequence= must be an open sequence of this model, got {seq!r:.80}")
    if seq.unrun:
        raise InvalidRequestError("the sequence has tokens not run yet (unrun): continue it with generate()")
    if seq.busy:
        raise InvalidRequestError("a call on this sequence is running (a forward, a generation's step): await it first")
    reused = min(seq.shared_prefix(ids), len(ids) - 1)
    if reused < seq.n_past and not seq.rewinds:
        if restart:
            seq.keep(0)
            return 0
        raise InvalidRequestError(
            f"this sequence cannot rewind (recurrent state): it holds {seq.n_past} tokens, "
            f"of which only {reused} start the prompt"
        )
    seq.keep(reused)
    return reused


# -- chat ------------------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer: Tokenizer, template: ChatTemplate, text: str) -> list[int]:
    """Token ids of a rendered chat prompt, as llama.cpp's ``common_chat`` makes them.

    The rendered text is tokenized with special-token parsing and the vocabulary's own BOS/EOS
    (``add_special=True``); a BOS (EOS) the template wrote itself is removed first when the
    vocabulary adds one, so it is never doubled (``common/chat.cpp``,
    ``common_chat_template_direct_apply_impl``). An empty rendering gives what ``encode("")``
    gives (no ids, or the vocabulary's BOS/EOS); a chat turn refuses it.

    Raises:
        TokenizerError: from the tokenizer.
    """
    return tokenizer.encode(_chat_text(tokenizer, template, text), add_special=True, parse_special=True)


def _chat_text(tokenizer: Tokenizer, template: ChatTemplate, text: str) -> str:
    """The rendered text without the BOS/EOS text the vocabulary adds itself (:func:`chat_prompt_ids`)."""
    if tokenizer.add_bos and template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token) :]
    if tokenizer.add_eos and template.eos_token and text.endswith(template.eos_token):
        text = text[: -len(template.eos_token)]
    return text


class ChatSession:
    """A conversation with one KV cache kept between turns (from :meth:`Model.chat`).

    Each :meth:`send` renders the whole conversation with the chat template (and the generation
    prompt), tokenizes it (:func:`chat_prompt_ids`), keeps the longest prefix the KV cache already
    holds and prefills only the rest (a model with recurrent blocks, qwen35moe, reuses the cache only
    when the new prompt extends all of it, else prefills the whole prompt again); the reply is added
    to :attr:`messages` when the turn ends.
    A turn that fails or is cancelled leaves :attr:`messages` as it was before it. One turn runs
    at a time. Close the session (``async with``, or :meth:`close`) to free the KV cache.

    Attributes:
        messages: the conversation so far (``{"role": ..., "content": ...}`` dicts).
        template: the chat template.
    """

    def __init__(
        self,
        model: TextModel,
        template: ChatTemplate,
        *,
        system: str | None,
        options: SamplingOptions,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        from aioexperts._text.chat import ChatTemplate
        from aioexperts._text.sampling import SamplingOptions

        if system is not None and not isinstance(system, str):
            raise ConfigError(f"system must be a str, got {type(system).__name__}")
        if not isinstance(template, ChatTemplate):
            hint = " (compile a template's source with ChatTemplate(source))" if isinstance(template, str) else ""
            raise ConfigError(f"template must be a ChatTemplate, got {type(template).__name__}{hint}")
        if not isinstance(options, SamplingOptions):
            raise ConfigError(f"options must be a SamplingOptions, got {type(options).__name__}")
        self.model = model
        self.template = template
        self.options = options
        self.tools = tools
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self._seq: ModelSequence | None = model.sequence()
        self._busy = False
        self._stats = [GenerationStatistics()]

    @property
    def n_past(self) -> int:
        """Tokens the session's KV cache holds."""
        return self._seq.n_past if self._seq is not None else 0

    def statistics(self) -> GenerationStatistics:
        """The last turn's statistics (``reused_tokens``: prompt tokens kept from the KV cache)."""
        return self._stats[0]

    def send(
        self,
        content: str,
        *,
        options: SamplingOptions | None = None,
        sampler: Sampler | None = None,
        **sampling: Any,
    ) -> TextStream:
        """Add a user message and stream the assistant's reply.

        Args:
            content: the user's text (not empty).
            options: this turn's sampling options (default: the session's); or the single fields
                (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``)
                as keywords, over the session's options.
            sampler: a callable ``(logits, history) -> id`` instead of the sampler of ``options``.

        Returns:
            A :class:`TextStream` of the reply's text pieces.

        Raises:
            InvalidRequestError: empty or non-str content, a turn still running, the session closed.
            ChatTemplateError: the template fails on the conversation.
            ContextLengthError: the rendered conversation does not fit ``n_ctx``.
            ConfigError: bad sampling options.
        """
        if self._seq is None:
            raise InvalidRequestError("the chat session is closed")
        if self._busy:
            raise InvalidRequestError("a turn of this chat session is still running: finish or close its stream first")
        if not isinstance(content, str) or not content:
            raise InvalidRequestError("a chat message must be a non-empty str")
        if options is not None and sampling:
            raise ConfigError("pass either options=SamplingOptions(...) or single fields, not both")
        if isinstance(sampling.get("stop"), str):
            sampling["stop"] = (sampling["stop"],)
        try:
            opts = options if options is not None else replace(self.options, **sampling)
        except TypeError as exc:  # an unknown keyword
            raise ConfigError(f"send(): {exc}") from None
        smp = _make_sampler(opts, sampler)
        messages = [*self.messages, {"role": "user", "content": content}]
        text = self.template.render(messages, add_generation_prompt=True, tools=self.tools)
        if not _chat_text(self.model.tokenizer, self.template, text):
            raise InvalidRequestError("the chat template rendered an empty prompt")
        ids = self.model._check_ids(chat_prompt_ids(self.model.tokenizer, self.template, text))
        check_fits(self.model, len(ids))
        out = TextStream(self._stats)
        out._agen = self._turn(ids, opts, smp, messages, out)
        return out

    async def _turn(
        self,
        ids: list[int],
        opts: SamplingOptions,
        smp: Any,
        messages: list[dict[str, Any]],
        out: TextStream,
    ) -> AsyncGenerator[str, None]:
        seq = self._seq
        if seq is None:
            raise InvalidRequestError("the chat session is closed")
        if self._busy:
            raise InvalidRequestError("a turn of this chat session is still running: finish or close its stream first")
        self._busy = True
        reused = keep_prefix(self.model, seq, ids, restart=True)
        pieces: list[str] = []
        try:
            eog = _eog_ids(self.model, True)
            turn = _generate(self.model, seq, reused, ids, opts, smp, eog, self._stats, False, out)
            async with aclosing(turn) as inner:
                async for piece in inner:
                    pieces.append(piece)
                    yield piece
        finally:
            self._busy = False
        self.messages = [*messages, {"role": "assistant", "content": "".join(pieces)}]

    def close(self) -> None:
        """Free the KV cache (idempotent)."""
        if self._seq is not None:
            self._seq.close()
            self._seq = None

    async def __aenter__(self) -> ChatSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
