"""The whole model (:func:`load`, :class:`Model`): the file's checks, the expert store and runner, the
memory plan (KV cache, slab), and the sequences (:class:`ModelSequence`) whose tokens go through the
one forward pass of :mod:`aioexperts._model.forward`; text in and out through
:mod:`aioexperts._model.text`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from aioexperts._batch import DEFAULT_BATCH_WAIT
from aioexperts._compute import fused
from aioexperts._compute.fused import Precision
from aioexperts._compute.grouped import warm_decode_kernels
from aioexperts._compute.moe import prepare_router_row
from aioexperts._compute.pool import compute_pool
from aioexperts._errors import (
    AioExpertsError,
    ConfigError,
    FormatError,
    InvalidRequestError,
    StoreClosedError,
)
from aioexperts._format.architectures import ModelHParams, model_hparams
from aioexperts._format.archs import MODEL_RECORDS
from aioexperts._format.model import GGUFModel, open_model
from aioexperts._model import memory as _memory
from aioexperts._model import text as _text
from aioexperts._model.blocks import GQABlock, RecurrentBlock
from aioexperts._model.config import DEFAULT_RESIDENT_EMBEDDING_BYTES, LoadOptions
from aioexperts._model.forward import ForwardCounters, ForwardPass, ModelWeights, load_weights
from aioexperts._model.kvcache import KV_ELEMENT_BYTES, KVCache, KVType, cache_bytes_per_position, state_bytes
from aioexperts._model.memory import SlabBudget, choose_slab_bytes, kv_bytes_per_position, kv_reserve_bytes
from aioexperts._model.sessions import Generation, ModelSequence, Sampler
from aioexperts._options import CacheOptions, IOOptions, MissTier, PageCacheOptions
from aioexperts._pipeline import run_in_worker
from aioexperts._runner import MoERunner, PrefetchOptions
from aioexperts._store import ExpertStore
from aioexperts._store import open as open_store

if TYPE_CHECKING:
    from aioexperts._text.chat import ChatTemplate
    from aioexperts._text.sampling import SamplingOptions
    from aioexperts._text.tokenizer import Tokenizer

__all__ = ("DEFAULT_MEMORY_BUDGET", "Generation", "Model", "ModelSequence", "ModelStatistics", "Sampler", "load")

log = logging.getLogger("aioexperts")

DEFAULT_MEMORY_BUDGET = 1 << 30
"""Bytes one sequence's KV cache may take when ``n_ctx`` is not given (1 GiB)."""


@dataclass(frozen=True, slots=True)
class ModelStatistics:
    """A snapshot of a model's counters (:meth:`Model.statistics`).

    Attributes:
        dense_bytes: bytes of the resident non-expert weights, matrices in their ggml type.
        embedding_resident: whether the token embedding table is in memory (else read by rows).
        kv_bytes_per_position: KV cache bytes one position takes over every layer.
        n_ctx: positions of each sequence's KV cache.
        live_sequences: sequences whose KV cache is allocated.
        kv_bytes_in_use: their KV cache bytes.
        tokens_prefilled, tokens_decoded: tokens run in batches of more than one / one at a time.
        attention_seconds: compute-pool time of the norms and attention (projections included).
        dense_ffn_seconds: the leading dense blocks' FFN.
        moe_seconds: wall time of the MoE layers (routing, expert waits, expert compute).
        head_seconds: output norm and head.
        sampling_seconds: choosing the next token.
        batched_steps: decode steps that ran several sequences' tokens together (cross-request
            batching, :mod:`aioexperts._model.forward`).
        batched_tokens: the tokens of those steps.
        batch_window_seconds: time decode steps waited for their sequences, summed.
        stall_seconds: time the MoE layers waited for expert reads with nothing to compute
            (the runner's ``stall_seconds``); per token: divide by the tokens run.
    """

    dense_bytes: int
    embedding_resident: bool
    kv_bytes_per_position: int
    n_ctx: int
    live_sequences: int
    kv_bytes_in_use: int
    tokens_prefilled: int
    tokens_decoded: int
    attention_seconds: float
    dense_ffn_seconds: float
    moe_seconds: float
    head_seconds: float
    sampling_seconds: float
    batched_steps: int = 0
    batched_tokens: int = 0
    batch_window_seconds: float = 0.0
    stall_seconds: float = 0.0

    @property
    def stall_seconds_per_token(self) -> float | None:
        """``stall_seconds`` over the tokens run (prefilled and decoded); None before any."""
        n = self.tokens_prefilled + self.tokens_decoded
        return self.stall_seconds / n if n else None


def _whole_model_hparams(model: GGUFModel) -> ModelHParams:
    """:func:`model_hparams`, with the file named and the two common wrong kinds of file said plainly.

    Raises:
        FormatError: no tensors (a vocabulary-only GGUF), or no token embeddings (an MoE-only file,
            e.g. the bench's model), or a missing or malformed key (the file is named).
        UnsupportedTypeError: an architecture without a whole-model record.
    """
    if not model.tensors:
        raise FormatError(
            f"{model.path}: the file holds no tensors (a vocabulary-only GGUF): there is no model to run; "
            "aioexperts.Tokenizer.from_gguf reads its vocabulary"
        )
    if model.architecture in MODEL_RECORDS and "token_embd.weight" not in model.tensors:
        raise FormatError(
            f"{model.path}: there is no 'token_embd.weight': the file holds MoE layers only, not a whole model; "
            "stream its experts with aioexperts.open() and run its layers with aioexperts.MoERunner"
        )
    try:
        return model_hparams(model)
    except FormatError as exc:
        if str(model.path) in str(exc):
            raise
        raise type(exc)(f"{model.path}: {exc}") from exc  # UnsupportedTypeError stays one


class Model:
    """A whole MoE model: forward pass, KV caches, generation (from :func:`load`).

    Attributes:
        path: the model file.
        hparams: the whole-model hyper-parameters (attention, RoPE, norms, vocabulary, MoE).

    Concurrency: any number of sequences may run at once; their compute shares the bounded
    compute pool, so they never oversubscribe the cores.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: LoadOptions,
        *,
        store_options: dict[str, Any],
        runner: Callable[[ExpertStore, PrefetchOptions | None], MoERunner] | None = None,
    ) -> None:
        if not isinstance(options, LoadOptions):
            raise ConfigError(f"options must be a LoadOptions, got {options!r}")
        self.path = os.fspath(path)
        self.options = options
        """The model's options, decided once by :func:`load`."""
        self._store_options = store_options
        self._make_runner = runner if runner is not None else self._default_runner
        self.slab_budget: SlabBudget | None = None
        """How the slab was sized from the memory limit (None: sized by the caller, or page-cache mode)."""
        self._store: ExpertStore | None = None
        self._runner: MoERunner | None = None
        self._pass: ForwardPass | None = None
        self._hparams: ModelHParams | None = None
        self._n_ctx = 0
        self._kv_per_position = 0
        self._layer_shapes: list[dict[str, tuple[int, ...]]] = []
        self._kv_types: list[KVType] = []
        self._layer_states: list[dict[str, tuple[int, ...]]] = []  # recurrent blocks' per-sequence state
        self._state_bytes = 0
        self._moe_layers: frozenset[int] = frozenset()
        self._live: set[int] = set()
        self._live_bytes = 0
        self._counters = ForwardCounters()
        self._closed = False
        self._tokenizer: Tokenizer | None = None
        self._chat_template: ChatTemplate | None = None
        #: what building the tokenizer and the chat template in start() raised (raised again at use)
        self._text_errors: tuple[Exception | None, Exception | None] = (None, None)

    # -- life cycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Model:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _default_runner(self, store: ExpertStore, prefetch: PrefetchOptions | None) -> MoERunner:
        return MoERunner(
            store,
            prefetch=prefetch,
            batch_wait=self.options.batch_wait,
            hits_first=self.options.hits_first,
            record_trace=self.options.record_trace,
        )

    async def start(self) -> None:
        """Parse the file, refuse what cannot run, open the expert store, load the dense weights.

        Raises:
            UnsupportedTypeError: the architecture (or one of its parts) is not supported; raised
                before the store opens, so before any expert read.
            FormatError: a required tensor or key is missing or malformed (no output norm, no
                token embeddings, a vocabulary-only file, NaN in a norm or bias).
            ConfigError: ``n_ctx`` does not fit ``memory_budget`` or the memory the process may
                still use (its KV cache is refused before it is allocated, and before the store
                opens), or a bad store option.
            As :func:`aioexperts.open` and :meth:`ExpertStore.start`.
        """
        if self._store is not None or self._closed:
            raise ConfigError("the model was already started")
        gguf = await run_in_worker(open_model, self.path)
        hp = _whole_model_hparams(gguf)  # refuses unsupported architectures before any store work
        # the memory limit is read from /proc and the cgroup files: in a worker, not on the loop
        options = await run_in_worker(self._plan_memory, gguf, hp)
        store = open_store(self.path, **options)
        await store.start()
        try:
            moe_layers = frozenset(store.layout.layers)
            runner = self._make_runner(store, self.options.prefetch)
            self.options.apply_to(runner)  # a factory's runner too: honoured, or refused
            await runner.warmup()
            weights = await run_in_worker(
                load_weights, store.model, hp, moe_layers, self.options.resident_embedding_bytes
            )
            if self.options.precision is not None:
                fused.set_precision(self.options.precision)
            await run_in_worker(fused.warmup, weights.ggml_types())
            await run_in_worker(warm_decode_kernels, weights.ggml_types(), self.options.kv_type == "f16")
            await run_in_worker(_prepare_decode_steps, weights, runner)
            self._layer_shapes = [dict(layer.block.cache_shapes()) for layer in weights.layers]
            # deepseek4's cache arrays stay float32 whatever the KV type (its compressor state must); the
            # block rounds what llama.cpp keeps in the KV type to F16 itself (DSV4Block.f16_cache)
            self._kv_types = [
                "f32" if getattr(layer.block, "kv_float32", False) else self.options.kv_type for layer in weights.layers
            ]
            for layer in weights.layers:
                if hasattr(layer.block, "f16_cache"):
                    layer.block.f16_cache = self.options.kv_type == "f16"
            self._kv_per_position = cache_bytes_per_position(self._layer_shapes, self._kv_types)
            self._layer_states = [
                dict(layer.block.state_shapes()) if isinstance(layer.block, RecurrentBlock) else {}
                for layer in weights.layers
            ]
            self._state_bytes = state_bytes(self._layer_states)
            self._n_ctx = await run_in_worker(self._choose_n_ctx, hp)
            # the text API's tokenizer and chat template read the file: built here, off the event loop,
            # rather than on the loop by the first generate() / stream() / chat() of a string (those
            # already built before the start, to check a prompt before the load, are kept)
            text = await run_in_worker(_text_parts, self.path, self._tokenizer, self._chat_template)
            self._tokenizer, self._chat_template, self._text_errors = text
        except BaseException:
            with anyio.CancelScope(shield=True):
                await store.aclose()
            raise
        self._store, self._runner, self._hparams = store, runner, hp
        self._pass = ForwardPass(store, runner, weights, hp, self.options.batch_wait, self._counters)
        self._moe_layers = moe_layers

    def _plan_memory(self, gguf: GGUFModel, hp: ModelHParams) -> dict[str, Any]:
        """Before any store work (a worker thread: it reads the memory limit): refuse a KV cache
        that cannot fit, and size the slab from the limit when no size was given. Returns the
        store's options."""
        element = 4 if hp.record.block == "dsv4" else KV_ELEMENT_BYTES[self.options.kv_type]
        per_position = kv_bytes_per_position(hp, gguf, element)
        if self.options.n_ctx is not None:  # a KV cache that cannot fit: refused before any store work
            self._check_kv_budget(self.options.n_ctx, per_position)
            _memory.check_kv_fits(self.options.n_ctx, self.options.n_ctx * per_position)
            if self.options.n_ctx > hp.n_ctx_train:  # said before the weights load, as llama.cpp warns
                log.warning("n_ctx=%d is larger than the file's context length %d", self.options.n_ctx, hp.n_ctx_train)
        options = self._store_options
        if options["mode"] == "slab" and all(options[k] is None for k in ("slots", "cache_bytes", "cache")):
            kv = kv_reserve_bytes(
                hp, self.options.n_ctx, self.options.memory_budget or DEFAULT_MEMORY_BUDGET, per_position
            )
            self.slab_budget = choose_slab_bytes(
                gguf, hp, kv_bytes=kv, resident_embedding_bytes=self.options.resident_embedding_bytes
            )
            options = {**options, "cache_bytes": self.slab_budget.slab_bytes}
        return options

    def _check_kv_budget(self, n_ctx: int, per: int) -> None:
        if self.options.memory_budget is not None and n_ctx * per > self.options.memory_budget:
            raise ConfigError(
                f"n_ctx={n_ctx} needs {n_ctx * per} bytes of KV cache per sequence, more than "
                f"memory_budget={self.options.memory_budget}"
            )

    def _choose_n_ctx(self, hp: ModelHParams) -> int:
        """``n_ctx`` for the built blocks' exact KV cache size, checked against ``memory_budget`` and
        the memory limit (:func:`~aioexperts._model.memory.check_kv_fits`) before any is allocated."""
        per = self._kv_per_position
        if self.options.n_ctx is not None:
            n_ctx = self.options.n_ctx
            self._check_kv_budget(n_ctx, per)
            _memory.check_kv_fits(n_ctx, n_ctx * per)
            return n_ctx
        budget = self.options.memory_budget if self.options.memory_budget is not None else DEFAULT_MEMORY_BUDGET
        if budget < per:  # not one position: never start over the budget
            raise ConfigError(
                f"memory_budget={budget} bytes holds no position of the KV cache ({per} bytes per position)"
            )
        n_ctx = min(hp.n_ctx_train, budget // per)
        limit = _memory.read_memory_limit(reclaimable=True)
        if n_ctx * per > limit.available:  # the default must fit the memory left too
            n_ctx = max(1, limit.available // per)
            _memory.check_kv_fits(n_ctx, n_ctx * per, limit)  # not even one position
            log.warning(
                "n_ctx = %d: the KV cache is capped to the %.1f MiB this process may still use (%s)",
                n_ctx,
                limit.available / 2**20,
                limit.source,
            )
        log.info(
            "n_ctx = %d (file context length %d; KV cache %.1f MiB per sequence, budget %.1f MiB)",
            n_ctx,
            hp.n_ctx_train,
            n_ctx * per / 2**20,
            budget / 2**20,
        )
        return n_ctx

    async def aclose(self) -> None:
        """Close the expert store (idempotent); sequences still open can no longer run."""
        self._closed = True
        store, self._store = self._store, None
        if store is not None:
            await store.aclose()

    # -- properties -----------------------------------------------------------------------------

    def _started(self) -> tuple[ExpertStore, MoERunner, ForwardPass, ModelHParams]:
        if self._closed:
            raise StoreClosedError("the model is closed")
        if self._store is None or self._runner is None or self._pass is None or self._hparams is None:
            raise StoreClosedError("the model is not started: use `async with aioexperts.load(path) as model:`")
        return self._store, self._runner, self._pass, self._hparams

    def _forget(self, seq: ModelSequence) -> None:
        if self._pass is not None:
            self._pass.forget(seq)

    @property
    def hparams(self) -> ModelHParams:
        """The resolved hyper-parameters (after start)."""
        return self._started()[3]

    @property
    def store(self) -> ExpertStore:
        """The expert store."""
        return self._started()[0]

    @property
    def runner(self) -> MoERunner:
        """The MoE runner."""
        return self._started()[1]

    @property
    def forward_pass(self) -> ForwardPass:
        """The forward pass (its resident weights, counters and step batcher).

        Raises:
            StoreClosedError: the model is not started or closed.
        """
        return self._started()[2]

    @property
    def n_ctx(self) -> int:
        """Positions of every sequence's KV cache."""
        return self._n_ctx

    @property
    def n_vocab(self) -> int:
        """Vocabulary size (rows of ``token_embd.weight``)."""
        return self.hparams.n_vocab

    def statistics(self) -> ModelStatistics:
        """A frozen snapshot of the model's counters (the store and runner have their own)."""
        c = self._counters
        w = self._pass.weights if self._pass is not None else None
        steps = self._pass.steps.counters if self._pass is not None else None
        return ModelStatistics(
            dense_bytes=w.n_bytes if w else 0,
            embedding_resident=bool(w and w.embedding is not None),
            kv_bytes_per_position=self._kv_per_position,
            n_ctx=self._n_ctx,
            live_sequences=len(self._live),
            kv_bytes_in_use=self._live_bytes,
            tokens_prefilled=c.tokens_prefilled,
            tokens_decoded=c.tokens_decoded,
            attention_seconds=c.attention_seconds,
            dense_ffn_seconds=c.dense_ffn_seconds,
            moe_seconds=c.moe_seconds,
            head_seconds=c.head_seconds,
            sampling_seconds=c.sampling_seconds,
            batched_steps=steps.batches if steps else 0,
            batched_tokens=steps.batched_calls if steps else 0,
            batch_window_seconds=steps.window_seconds if steps else 0.0,
            stall_seconds=self._runner.statistics().stall_seconds if self._runner is not None else 0.0,
        )

    # -- sequences ------------------------------------------------------------------------------

    def sequence(self) -> ModelSequence:
        """A new sequence with its KV cache preallocated for :attr:`n_ctx` positions.

        Raises:
            StoreClosedError: the model is not started or closed.
        """
        self._started()
        seq = ModelSequence(self, KVCache(self._layer_shapes, self._n_ctx, self._layer_states, self._kv_types))
        self._live.add(id(seq))
        self._live_bytes += self._n_ctx * self._kv_per_position + self._state_bytes
        return seq

    def _sequence_closed(self, seq: ModelSequence) -> None:
        if id(seq) in self._live:
            self._live.discard(id(seq))
            self._live_bytes -= self._n_ctx * self._kv_per_position + self._state_bytes

    async def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits of a fresh sequence at every position of ``token_ids`` (one batch).

        Returns:
            float32 ``(n_tokens, n_vocab)``.

        Raises:
            As :meth:`ModelSequence.forward`.
        """
        self._check_ids(token_ids)
        async with self.sequence() as seq:
            return await seq.forward(token_ids)

    # -- text in, text out (aioexperts/_model/text.py) -------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer of the model file (needs the ``text`` extra for BPE): built by :meth:`start` in a
        worker thread, or here on first use before that.

        Raises:
            VocabularyError: the file's ``tokenizer.ggml.*`` keys are missing or malformed.
            OptionalDependencyError: ``tokenizers`` is not installed (``pip install 'aioexperts[text]'``).
        """
        if self._tokenizer is None:
            if self._text_errors[0] is not None:  # what start() met building it
                raise self._text_errors[0]
            from aioexperts._text.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_gguf(self.path)
        return self._tokenizer

    @property
    def chat_template(self) -> ChatTemplate:
        """The file's ``tokenizer.chat_template`` (needs ``jinja2``): compiled by :meth:`start` in a worker
        thread, or here on first use before that.

        Raises:
            ChatTemplateError: the file has none, or it does not compile.
        """
        if self._chat_template is None:
            if self._text_errors[1] is not None:  # what start() met compiling it
                raise self._text_errors[1]
            from aioexperts._text.chat import ChatTemplate

            self._chat_template = ChatTemplate.from_gguf(self.path)
        return self._chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render ``messages`` with the file's chat template; with ``tokenize``, the prompt's token ids.

        The ids are those a :meth:`chat` session runs (special tokens parsed, no doubled BOS:
        :func:`aioexperts._model.text.chat_prompt_ids`); an empty rendering gives what
        ``tokenizer.encode("")`` gives (``[]``, or the BOS the vocabulary adds).

        Raises:
            ChatTemplateError: no template, or it fails on ``messages``.
            TokenizerError: as :meth:`Tokenizer.encode` (``tokenize=True``).
        """
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        if not tokenize:
            return text
        return _text.chat_prompt_ids(self.tokenizer, self.chat_template, text)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        sampler: Sampler | None = None,
        seed: int | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        options: SamplingOptions | None = None,
        add_special: bool = True,
        parse_special: bool = False,
    ) -> Generation | _text.TokenStream:
        """New token ids after ``prompt`` on a fresh sequence, freed when the generation ends.

        ``async for token in model.generate(ids, max_tokens=16):`` or ``model.generate("Hello", max_tokens=16)``.

        Two paths:

        - token ids with only ``max_tokens`` / ``temperature`` / ``sampler`` / ``seed``: a
          :class:`Generation` (see :meth:`ModelSequence.generate`: greedy, or a draw from
          ``softmax(logits / temperature)``; ``max_tokens`` defaults to 256).
        - a text prompt, or any of ``top_k``, ``top_p``, ``min_p``, ``stop``, ``options``: llama.cpp's
          sampler chain (:class:`SamplingOptions`; greedy unless ``temperature`` is given) through
          :mod:`aioexperts._model.text`, giving a :class:`~aioexperts._model.text.TokenStream`
          (``statistics``; it ends at a stop string, after the token that completes it, and when
          the KV cache is full, with ``stop_reason == "length"``). Text is tokenized with the model's
          tokenizer (``add_special``: the vocabulary's BOS; ``parse_special``: ``<|...|>`` texts
          become their control tokens); the tokenizer's end-of-generation ids also stop it.

        Raises:
            InvalidRequestError: an empty prompt, an id out of range, bad arguments of the ids path.
            ContextLengthError: the prompt is longer than :attr:`n_ctx` (never truncated). A
                generation that fills the KV cache (prompt plus generated tokens reach ``n_ctx``,
                the server's limit) stops there, on every path, with ``stop_reason == "length"``.
            ConfigError: a bad sampling option, or both ``options`` and single fields.
            TokenizerError, OptionalDependencyError: from the tokenizer (text prompts).
            As :meth:`ModelSequence.forward`, while iterating.
        """
        chain = isinstance(prompt, str) or any(v is not None for v in (top_k, top_p, min_p, stop, options))
        if chain:
            sampling = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stop": stop}
            sampling |= {"top_k": top_k, "top_p": top_p, "min_p": min_p}
            run = _text.open_run(
                self, prompt, options=options, sampler=sampler, add_special=add_special,
                parse_special=parse_special, sampling=sampling, as_text=False,
            )  # fmt: skip
            assert isinstance(run, _text.TokenStream)
            return run
        assert not isinstance(prompt, str)
        ids = self._check_ids(prompt)
        _text.check_fits(self, len(ids))
        seq = self.sequence()
        try:
            return Generation(
                seq,
                ids,
                _text.DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                0.0 if temperature is None else temperature,
                sampler,
                seed,
                owns_sequence=True,
            )
        except BaseException:
            seq.close()
            raise

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        options: SamplingOptions | None = None,
        sampler: Sampler | None = None,
        add_special: bool = True,
        parse_special: bool = False,
        sequence: ModelSequence | None = None,
    ) -> _text.TextStream:
        """Text pieces of the continuation of ``prompt``, as they are decoded.

        ``async for piece in model.stream("Hello", max_tokens=16): print(piece, end="")``

        The arguments and errors are :meth:`generate`'s. ``sequence``: continue this open sequence
        (not running) instead of a fresh one: the longest prefix of the prompt's ids it holds is kept
        (``statistics.reused_tokens``), only the rest is prefilled, and the sequence stays open
        (a prompt cache across requests; InvalidRequestError when it is closed, of another model,
        or cannot rewind to that prefix: :attr:`ModelSequence.rewinds`). No piece ends inside a
        UTF-8 character;
        the pieces join to ``tokenizer.decode`` of the generated ids; a stop string (even split
        across tokens) ends the stream and is not emitted, nor anything after it.

        Returns:
            A :class:`~aioexperts._model.text.TextStream` (async iterator of str, ``statistics``,
            ``token_ids``).
        """
        sampling = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stop": stop}
        sampling |= {"top_k": top_k, "top_p": top_p, "min_p": min_p}
        stream = _text.open_run(
            self, prompt, options=options, sampler=sampler, add_special=add_special,
            parse_special=parse_special, sampling=sampling, as_text=True, sequence=sequence,
        )  # fmt: skip
        assert isinstance(stream, _text.TextStream)
        return stream

    def chat(
        self,
        system: str | None = None,
        *,
        options: SamplingOptions | None = None,
        template: ChatTemplate | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> _text.ChatSession:
        """A chat session that keeps its KV cache between turns (``await``-free; close it after).

        ``async with model.chat("You are terse.") as chat: async for p in chat.send("Hi"): ...``

        Args:
            system: a system message to start the conversation with.
            options: the session's sampling options (default: llama.cpp's, greedy).
            template: a chat template instead of the file's.
            tools: tool schemas passed to the template on every turn.

        Raises:
            ChatTemplateError: the file has no chat template (and none is given).
            ConfigError: ``template`` not a :class:`~aioexperts._text.chat.ChatTemplate` (a source
                string too: compile it with ``ChatTemplate(source)``), ``options`` not a
                :class:`SamplingOptions`, ``system`` not a str.
            StoreClosedError: the model is not started or closed.
        """
        from aioexperts._text.sampling import SamplingOptions

        return _text.ChatSession(
            self,
            template if template is not None else self.chat_template,
            system=system,
            options=options if options is not None else SamplingOptions(temperature=0.0),
            tools=tools,
        )

    # -- the forward pass -----------------------------------------------------------------------

    def _check_ids(self, token_ids: Sequence[int], *, allow_empty: bool = False) -> list[int]:
        hp = self._started()[3]
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence | np.ndarray):
            raise InvalidRequestError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
        ids = []
        for t in token_ids:
            if isinstance(t, np.integer):
                t = int(t)
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"token ids must be ints, got {t!r}")
            if not 0 <= t < hp.n_vocab:
                raise InvalidRequestError(f"token id {t} is out of range 0..{hp.n_vocab - 1}")
            ids.append(t)
        if not ids and not allow_empty:
            raise InvalidRequestError("token_ids is empty: the forward pass needs at least one token")
        return ids

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("started" if self._store is not None else "not started")
        return f"Model({self.path!r}, {state}, n_ctx={self._n_ctx})"


def _text_parts(
    path: str, tokenizer: Tokenizer | None = None, template: ChatTemplate | None = None
) -> tuple[Tokenizer | None, ChatTemplate | None, tuple[Exception | None, Exception | None]]:
    """Worker job of :meth:`Model.start`: the file's tokenizer and chat template (those given, already
    built, are kept), and what building each raised instead (no vocabulary or template in the file, no
    ``text`` extra, a malformed vocabulary): the properties :attr:`Model.tokenizer` and
    :attr:`Model.chat_template` raise that at first use, as they did when they built them there."""
    from aioexperts._text.chat import ChatTemplate
    from aioexperts._text.tokenizer import Tokenizer

    errors: list[Exception | None] = [None, None]
    if tokenizer is None:
        try:
            tokenizer = Tokenizer.from_gguf(path)
        except (AioExpertsError, OSError) as exc:
            errors[0] = exc
    if template is None:
        try:
            template = ChatTemplate.from_gguf(path)
        except (AioExpertsError, OSError) as exc:
            errors[1] = exc
    return tokenizer, template, (errors[0], errors[1])


def load(
    path: str | os.PathLike[str],
    *,
    n_ctx: int | None = None,
    memory_budget: int | None = None,
    prefetch: PrefetchOptions | None = None,
    slots: int | None = None,
    cache_bytes: int | None = None,
    cache: CacheOptions | None = None,
    io: IOOptions | None = None,
    expert_map: str | os.PathLike[str] | None = None,
    mode: str = "slab",
    pagecache: PageCacheOptions | None = None,
    resident_embedding_bytes: int = DEFAULT_RESIDENT_EMBEDDING_BYTES,
    runner: Callable[[ExpertStore, PrefetchOptions | None], MoERunner] | None = None,
    batch_wait: float | None = DEFAULT_BATCH_WAIT,
    hits_first: bool = True,
    record_trace: bool = False,
    kv_type: KVType = "f16",
    precision: Precision | None = None,
    miss_tier: MissTier | None = None,
) -> Model:
    """Prepare the whole model at ``path``; start it with ``async with``.

    Example::

        import asyncio
        import aioexperts
        from aioexperts.testing import builtin_model_path

        async def main() -> None:
            async with aioexperts.load(builtin_model_path(), slots=256, n_ctx=4096) as model:
                logits = await model.logits([1, 2, 3])          # (3, n_vocab) float32
                async for token in model.generate([1, 2, 3], max_tokens=16):
                    print(token)

        asyncio.run(main())

    Args:
        path: a GGUF file (or a shard of a split set) of a supported architecture
            (``qwen3moe``, ``qwen2moe``, ``glm4moe``, ``llama`` with experts, ``olmoe``,
            ``granitemoe``, ``gpt-oss``, ``deepseek2``, ``qwen35moe``; docs/model.md).
        n_ctx: positions of each sequence's KV cache; default the file's ``context_length``,
            capped to what ``memory_budget`` and the memory limit allow (logged once). A given
            ``n_ctx`` whose KV cache is larger than the memory the process may still use (cgroup
            limit, ``RLIMIT_AS``, ``MemAvailable``: :mod:`aioexperts._model.memory`) is refused with
            ``ConfigError`` when the model starts, before anything is allocated.
        memory_budget: bytes one sequence's KV cache may take (default 1 GiB when ``n_ctx`` is not
            given; when it is, only checked if given).
        prefetch: the MoE runner's prefetch options.
        slots, cache_bytes, cache, io, expert_map, mode, pagecache: as :func:`aioexperts.open`;
            with none of ``slots``, ``cache_bytes``, ``cache`` in slab mode, the slab is sized from
            the memory limit the process runs under (cgroup v2/v1, ``RLIMIT_AS``, ``MemAvailable``),
            leaving room for the resident weights, the KV cache and a reserve
            (:mod:`aioexperts._model.memory`; logged, and kept in :attr:`Model.slab_budget`).
        resident_embedding_bytes: a token embedding table larger than this (with a separate output
            head) is read by rows through the store instead of kept in memory.
        runner: ``(store, prefetch) -> MoERunner``, called once the store is started, to run the
            MoE layers (default ``MoERunner(store, prefetch=prefetch, batch_wait=batch_wait,
            hits_first=hits_first)``; expert shards:
            ``aioexperts.distributed.ShardedRunner.factory``, docs/distributed.md).
        batch_wait: cross-request expert batching of the sequences that decode at the same moment
            (each in its own task): seconds a layer's step waits at most for the other sequences
            on their way to that layer (default 0.05; a lone sequence never waits). Every
            sequence's numbers are bit for bit those it gets alone. 0 or None: off.
        hits_first: compute each layer's resident experts while its other experts are read
            (the result does not change).
        record_trace: record every routing decision (:meth:`MoERunner.routing_trace` of
            :attr:`Model.runner`).
        kv_type: the KV cache's element type: ``"f16"`` (default, llama.cpp's ``type_k``/``type_v``:
            half the memory, llama.cpp's rounding and flash attention arithmetic) or ``"f32"``.
        precision: the arithmetic of every matrix product, for the whole process (the kernels'
            switch, :func:`aioexperts._compute.fused.set_precision`): ``"int8"`` (llama.cpp's:
            activations rounded to each weight type's ``vec_dot_type``, integer dot products; about
            2e-2 relative from llama.cpp's logits on the quantized fixtures) or ``"float"`` (float32
            activations: up to 0.1 from llama.cpp where near-tie routing flips; the int8 kernels are
            the faster ones per call). None (default): ``$AIOEXPERTS_PRECISION``, else ``"int8"``.
        miss_tier: the low-precision miss tier (opt-in, :class:`~aioexperts.MissTier`, as
            :func:`aioexperts.open`): misses its policy chooses are read from a sidecar of smaller
            experts (``aioexperts-tier``; docs/miss-tier.md). Default off: the numerics do not change.

    Returns:
        A :class:`Model`, not started.

    Raises:
        ConfigError: a bad argument (more are checked when the model starts).
    """
    if runner is not None and not callable(runner):
        raise ConfigError(f"runner must be a callable (store, prefetch) -> MoERunner, got {runner!r}")
    config = LoadOptions(
        n_ctx=n_ctx,
        memory_budget=memory_budget,
        prefetch=prefetch,
        resident_embedding_bytes=resident_embedding_bytes,
        batch_wait=batch_wait,  # type: ignore[arg-type]  # None is 0 (off), checked
        hits_first=hits_first,
        record_trace=record_trace,
        kv_type=kv_type,
        precision=precision,
    )
    options: dict[str, Any] = {
        "slots": slots,
        "cache_bytes": cache_bytes,
        "cache": cache,
        "io": io,
        "expert_map": expert_map,
        "mode": mode,
        "pagecache": pagecache,
        "miss_tier": miss_tier,
    }
    return Model(path, config, store_options=options, runner=runner)


def _prepare_decode_steps(weights: ModelWeights, runner: MoERunner) -> None:
    """What a first decode step would make per layer, made at load: each GQA block's prepared
    one-token attention step and each router's one-row product plan, for the compute pool's
    threads (about 0.3 ms a layer). Blocking (a worker thread)."""
    parts = compute_pool().n_threads
    for layer in weights.layers:
        if isinstance(layer.block, GQABlock):
            layer.block.prepare_decode(parts)
    if runner.router.ready:
        for resident in runner.router.residents.values():
            prepare_router_row(resident)
