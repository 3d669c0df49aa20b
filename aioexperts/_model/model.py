"""The whole model: embeddings, blocks (attention + MoE or dense FFN), output norm and head.

Per block, as the graphs of llama.cpp's ``src/models/<arch>.cpp`` chain it::

    h       = rms_norm(x, attn_norm)                       # build_norm(LLM_NORM_RMS)
    ffn_inp = x + attention(h) * residual_scale            # granite.cpp build_layer_ffn scales
    f       = moe(rms_norm(ffn_inp, ffn_norm))             # MoERunner.moe, or the dense SwiGLU FFN
    x       = ffn_inp + f * residual_scale                 # of the leading dense blocks

then ``logits = output(rms_norm(x, output_norm)) / logit_scale``. One compute-pool job runs the
residual add of the previous block, the attention norm, the attention, the FFN norm and the MoE
layer's routing (with the prediction of the next layers' experts); the rest of the MoE layer goes
through :class:`~aioexperts.MoERunner` (expert reads, prefetch of the next layers' experts while
this one computes, the experts' compute and their sum in one more job). A runner whose ``moe`` is
overridden routes in its own job.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from aioexperts._batch import DEFAULT_BATCH_WAIT
from aioexperts._compute import fused
from aioexperts._compute.fused import Precision
from aioexperts._compute.norms import rms_norm
from aioexperts._errors import (
    AioExpertsError,
    ConfigError,
    ContextLengthError,
    FormatError,
    InvalidRequestError,
    StoreClosedError,
    UnsupportedTypeError,
)
from aioexperts._format.architectures import ModelHParams, model_hparams
from aioexperts._format.archs import MODEL_RECORDS
from aioexperts._format.model import GGUFModel, open_model
from aioexperts._model import memory as _memory
from aioexperts._model import text as _text
from aioexperts._model.blocks import BLOCKS, AttentionBlock
from aioexperts._model.config import DEFAULT_RESIDENT_EMBEDDING_BYTES, LoadOptions
from aioexperts._model.decode_batch import DecodeRequest, decode_rows
from aioexperts._model.kvcache import KV_ELEMENT_BYTES, KVCache, KVType, cache_bytes_per_position
from aioexperts._model.memory import SlabBudget, choose_slab_bytes, kv_bytes_per_position, kv_reserve_bytes
from aioexperts._model.residual import after_attention, block_input, head_input, scale_logits
from aioexperts._model.steps import StepBatcher
from aioexperts._model.weights import DenseMatrix, TensorReader
from aioexperts._options import CacheOptions, IOOptions, PageCacheOptions
from aioexperts._pipeline import run_in_worker
from aioexperts._runner import BATCH_MAX_ROWS, MoERunner, PrefetchOptions
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


#: ``sampler(logits, history) -> token id``: ``logits`` is ``(n_vocab,)`` float32, ``history`` the
#: sequence's tokens so far (prompt and generated).
Sampler = Callable[[np.ndarray, Sequence[int]], int]


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
            batching, :mod:`aioexperts._model.decode_batch`).
        batched_tokens: the tokens of those steps.
        batch_window_seconds: time decode steps waited for their sequences, summed.
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


@dataclass(slots=True)
class _Counters:
    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    attention_seconds: float = 0.0
    dense_ffn_seconds: float = 0.0
    moe_seconds: float = 0.0
    head_seconds: float = 0.0
    sampling_seconds: float = 0.0


@dataclass(frozen=True, slots=True, eq=False)
class _DenseFFN:
    """A leading dense block's SwiGLU FFN (llama-graph.cpp ``build_ffn``, ``LLM_FFN_SILU, LLM_FFN_PAR``)."""

    gate: DenseMatrix
    up: DenseMatrix
    down: DenseMatrix

    def __call__(self, x: np.ndarray) -> np.ndarray:
        g = self.gate(x)
        u = self.up(x)
        with np.errstate(over="ignore"):
            h = (g / (1.0 + np.exp(-g))) * u  # ggml_swiglu_split: silu(gate) * up
        return self.down(np.ascontiguousarray(h, dtype=np.float32))


@dataclass(frozen=True, slots=True, eq=False)
class _Layer:
    index: int
    attn_norm: np.ndarray
    block: AttentionBlock
    ffn_norm: np.ndarray
    dense: _DenseFFN | None  # None: a MoE layer (through the runner)


@dataclass(slots=True, eq=False)
class _Weights:
    embedding: DenseMatrix | None  # None: read through store.read_rows
    output_norm: np.ndarray
    output: DenseMatrix
    layers: list[_Layer] = field(default_factory=list)
    n_bytes: int = 0


def _load_weights(model: GGUFModel, hp: ModelHParams, moe_layers: frozenset[int], resident_embedding: int) -> _Weights:
    """Read every non-expert tensor (blocking). Raises FormatError / UnsupportedTypeError."""
    reader = TensorReader(model)
    n_embd = hp.n_embd
    output_norm = reader.optional_array("output_norm.weight", (n_embd,))
    if output_norm is None:
        raise FormatError(f"{model.path}: tensor 'output_norm.weight' is missing: the model has no output norm")
    tok_info = model.tensor("token_embd.weight")
    has_head = reader.has("output.weight")
    if has_head:
        output = reader.matrix("output.weight", (hp.n_vocab, n_embd))
        embedding = reader.matrix("token_embd.weight") if tok_info.n_bytes <= resident_embedding else None
    else:  # tied: llama.cpp creates output from token_embd (TENSOR_DUPLICATED)
        if hp.record.name == "gpt-oss":  # openai-moe.cpp: output.weight is required
            raise FormatError(f"{model.path}: tensor 'output.weight' is missing: gpt-oss has no tied output head")
        embedding = reader.matrix("token_embd.weight")
        output = embedding
    factory = BLOCKS.get(hp.record.block)
    if factory is None:
        raise UnsupportedTypeError(
            f"architecture {hp.arch!r}: its attention block {hp.record.block!r} is not implemented"
        )
    layers = []
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        attn_norm = reader.array(p + "attn_norm.weight", (n_embd,))
        block = factory(hp, reader, il)
        ffn_norm = reader.array(p + hp.record.ffn_norm + ".weight", (n_embd,))
        dense = None
        if il not in moe_layers:
            if hp.moe.is_moe_layer(il):
                raise FormatError(f"{model.path}: block {il} should have routed experts but the layout has none")
            n_ff = hp.moe.n_ff
            dense = _DenseFFN(
                reader.matrix(p + "ffn_gate.weight", (n_ff, n_embd) if n_ff else None),
                reader.matrix(p + "ffn_up.weight", (n_ff, n_embd) if n_ff else None),
                reader.matrix(p + "ffn_down.weight", (n_embd, n_ff) if n_ff else None),
            )
        layers.append(_Layer(il, attn_norm, block, ffn_norm, dense))
    return _Weights(embedding, output_norm, output, layers, reader.n_bytes)


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


DECODE_BATCH_MAX_CALLS = 16
"""Sequences one batched decode step takes at most (:mod:`aioexperts._model.decode_batch`); more
open the next step. Its MoE layers go in calls of ``BATCH_MAX_CALLS`` sequences (``_runner``)."""


@dataclass(frozen=True, slots=True, eq=False)
class _StepCall:
    """A sequence's one-token decode step, for the step batcher."""

    cache: KVCache
    request: DecodeRequest


def _plain_moe(runner: MoERunner) -> bool:
    """Whether ``runner``'s :meth:`~MoERunner.moe` is the base class's (route, then the executor), so the
    model may route in its own job (a subclass that overrides ``moe`` or its routing keeps them)."""
    cls = type(runner)
    return all(getattr(cls, name) is getattr(MoERunner, name) for name in ("moe", "moe_result", "route_in_job"))


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

    def __init__(self, model: Model, cache: KVCache) -> None:
        self.model = model
        self._cache: KVCache | None = cache
        self.tokens: list[int] = []
        self.unrun: list[int] = []
        self._last_logits: np.ndarray | None = None  # of position n_past - 1
        self._lock = anyio.Lock()

    @property
    def n_past(self) -> int:
        """Positions already in the KV cache."""
        return len(self.tokens)

    @property
    def n_ctx(self) -> int:
        """Positions the KV cache holds."""
        return self.model.n_ctx

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._cache is None

    def keep(self, n: int) -> None:
        """Keep only the first ``n`` positions (``0 <= n <= n_past``); later calls continue from there.

        Raises:
            InvalidRequestError: ``n`` out of range, or the sequence is closed.
        """
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.n_past:
            raise InvalidRequestError(f"keep(n) needs 0 <= n <= n_past={self.n_past}, got {n!r}")
        if self._cache is None:
            raise InvalidRequestError("the sequence is closed")
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
            self.model._steps.forget(self)

    async def __aenter__(self) -> ModelSequence:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    async def forward(self, token_ids: Sequence[int], *, all_logits: bool = True) -> np.ndarray:
        """Run ``token_ids`` at the next positions (one batch), add them to the cache, return logits.

        Tokens in :attr:`unrun` run first (their logits are not returned).

        Args:
            token_ids: ids in ``0..n_vocab-1`` (one at least, unless :attr:`unrun` has some).
            all_logits: logits of every new position; False: of the last one only.

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
        ids = self.model._check_ids(token_ids, allow_empty=bool(self.unrun))
        async with self._lock:
            if self._cache is None:
                raise InvalidRequestError("the sequence is closed")
            run = self.unrun + ids
            if self.n_past + len(run) > self.n_ctx:
                raise ContextLengthError(
                    f"{len(run)} new tokens after {self.n_past} would pass n_ctx={self.n_ctx} positions "
                    "(load the model with a larger n_ctx, or --ctx of aioexperts-run and aioexperts-serve; "
                    "or keep() a shorter prefix)"
                )
            logits = await self.model._forward(
                self._cache, self.n_past, run, all_logits=all_logits or not ids, step_of=self
            )
            self.tokens.extend(run)
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
            InvalidRequestError: bad arguments or ids (here); a sampler returning something that
                is not a token id (while iterating).
            ContextLengthError: while iterating, when the prompt would pass ``n_ctx``.
            As :meth:`forward`, while iterating.
        """
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
        self.stop_reason: str | None = None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> int:
        seq = self._seq
        if seq is None or self._left <= 0:
            if seq is not None:
                self.stop_reason = "length"
            self._finish()
            raise StopAsyncIteration
        try:
            token = await self._step(seq)
        except BaseException:
            self._finish()
            raise
        if token is None:
            self._finish()
            raise StopAsyncIteration
        return token

    async def _step(self, seq: ModelSequence) -> int | None:
        model = seq.model
        if seq.n_past + len(seq.unrun) + len(self._pending) == seq.n_ctx:
            # every position is taken once these run: a new token would have none (more than
            # n_ctx: the forward refuses the prompt with ContextLengthError)
            if not self._owns:  # not run; the sequence's next call runs them first
                seq.unrun.extend(self._pending)
            self._pending = []
            self.stop_reason = "length"
            return None
        if not self._pending and not seq.unrun and seq._last_logits is not None:
            logits = seq._last_logits  # the last forward's, at the last cached position
            seq._last_logits = None
        else:
            if not self._pending and not seq.unrun:  # logits of the last cached position: run it again
                self._pending = [seq.tokens[-1]]
                seq.keep(seq.n_past - 1)
            logits = (await seq.forward(self._pending, all_logits=False))[0]
        t0 = time.perf_counter()
        if self._sampler is not None:
            token = self._sampler(logits, tuple(seq.tokens))
            if isinstance(token, np.integer):
                token = int(token)
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < model.n_vocab:
                raise InvalidRequestError(f"the sampler returned {token!r}, not a token id in 0..{model.n_vocab - 1}")
        elif self._temperature == 0:
            token = int(np.argmax(logits))
        else:
            z = logits.astype(np.float64) / self._temperature
            pr = np.exp(z - z.max())
            token = int(self._rng.choice(len(pr), p=pr / pr.sum()))
        model._counters.sampling_seconds += time.perf_counter() - t0
        if token in model.hparams.eog_ids:
            self.stop_reason = "eog"
            return None
        self._left -= 1
        self._pending = [token]
        if self._left == 0:  # the last token is not run; the sequence's next call runs it first
            if not self._owns:
                seq.unrun.append(token)
            self._pending = []
        return token

    def _finish(self) -> None:
        seq, self._seq = self._seq, None
        if seq is not None and self._owns:
            seq.close()

    async def aclose(self) -> None:
        """End the generation now (frees the KV cache of a generation that owns its sequence)."""
        self._finish()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._finish()

    def __del__(self) -> None:
        self._finish()


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
        self._weights: _Weights | None = None
        self._hparams: ModelHParams | None = None
        self._n_ctx = 0
        self._kv_per_position = 0
        self._layer_shapes: list[dict[str, tuple[int, ...]]] = []
        self._moe_layers: frozenset[int] = frozenset()
        self._live: set[int] = set()
        self._live_bytes = 0
        self._counters = _Counters()
        self._closed = False
        self._tokenizer: Tokenizer | None = None
        self._chat_template: ChatTemplate | None = None
        #: what building the tokenizer and the chat template in start() raised (raised again at use)
        self._text_errors: tuple[Exception | None, Exception | None] = (None, None)
        # cross-request batching: the one-token decode steps of sequences decoding at the same moment
        self._steps: StepBatcher[_StepCall, np.ndarray] = StepBatcher(
            self._run_steps, DECODE_BATCH_MAX_CALLS, self.options.batch_wait
        )

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
                _load_weights, store.model, hp, moe_layers, self.options.resident_embedding_bytes
            )
            types = {weights.output.ggml_type} | {
                m.ggml_type
                for layer in weights.layers
                for m in vars(layer.block).values()
                if isinstance(m, DenseMatrix)
            }
            types |= {
                m.ggml_type
                for layer in weights.layers
                if layer.dense
                for m in (layer.dense.gate, layer.dense.up, layer.dense.down)
            }
            if self.options.precision is not None:
                fused.set_precision(self.options.precision)
            await run_in_worker(fused.warmup, types)
            self._layer_shapes = [dict(layer.block.cache_shapes()) for layer in weights.layers]
            self._kv_per_position = cache_bytes_per_position(self._layer_shapes, self.options.kv_type)
            self._n_ctx = await run_in_worker(self._choose_n_ctx, hp)
            # the text API's tokenizer and chat template read the file: built here, off the event loop,
            # rather than on the loop by the first generate() / stream() / chat() of a string
            text = await run_in_worker(_text_parts, self.path)
            self._tokenizer, self._chat_template, self._text_errors = text
        except BaseException:
            with anyio.CancelScope(shield=True):
                await store.aclose()
            raise
        self._store, self._runner, self._weights, self._hparams = store, runner, weights, hp
        self._moe_layers = moe_layers

    def _plan_memory(self, gguf: GGUFModel, hp: ModelHParams) -> dict[str, Any]:
        """Before any store work (a worker thread: it reads the memory limit): refuse a KV cache
        that cannot fit, and size the slab from the limit when no size was given. Returns the
        store's options."""
        per_position = kv_bytes_per_position(hp, gguf, KV_ELEMENT_BYTES[self.options.kv_type])
        if self.options.n_ctx is not None:  # a KV cache that cannot fit: refused before any store work
            self._check_kv_budget(self.options.n_ctx, per_position)
            _memory.check_kv_fits(self.options.n_ctx, self.options.n_ctx * per_position)
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
            if n_ctx > hp.n_ctx_train:
                log.warning("n_ctx=%d is larger than the file's context length %d", n_ctx, hp.n_ctx_train)
            return n_ctx
        budget = self.options.memory_budget if self.options.memory_budget is not None else DEFAULT_MEMORY_BUDGET
        n_ctx = min(hp.n_ctx_train, max(1, budget // per))
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

    def _started(self) -> tuple[ExpertStore, MoERunner, _Weights, ModelHParams]:
        if self._closed:
            raise StoreClosedError("the model is closed")
        if self._store is None or self._runner is None or self._weights is None or self._hparams is None:
            raise StoreClosedError("the model is not started: use `async with aioexperts.load(path) as model:`")
        return self._store, self._runner, self._weights, self._hparams

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
        w = self._weights
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
            batched_steps=self._steps.counters.batches,
            batched_tokens=self._steps.counters.batched_calls,
            batch_window_seconds=self._steps.counters.window_seconds,
        )

    # -- sequences ------------------------------------------------------------------------------

    def sequence(self) -> ModelSequence:
        """A new sequence with its KV cache preallocated for :attr:`n_ctx` positions.

        Raises:
            StoreClosedError: the model is not started or closed.
        """
        self._started()
        seq = ModelSequence(self, KVCache(self._layer_shapes, self._n_ctx, self.options.kv_type))
        self._live.add(id(seq))
        self._live_bytes += self._n_ctx * self._kv_per_position
        return seq

    def _sequence_closed(self, seq: ModelSequence) -> None:
        if id(seq) in self._live:
            self._live.discard(id(seq))
            self._live_bytes -= self._n_ctx * self._kv_per_position

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
            run = _text.open_run(
                self,
                prompt,
                options=options,
                sampler=sampler,
                add_special=add_special,
                parse_special=parse_special,
                sampling={
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "top_k": top_k,
                    "top_p": top_p,
                    "min_p": min_p,
                    "seed": seed,
                    "stop": stop,
                },
                as_text=False,
            )
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
    ) -> _text.TextStream:
        """Text pieces of the continuation of ``prompt``, as they are decoded.

        ``async for piece in model.stream("Hello", max_tokens=16): print(piece, end="")``

        The arguments and errors are :meth:`generate`'s. No piece ends inside a UTF-8 character;
        the pieces join to ``tokenizer.decode`` of the generated ids; a stop string (even split
        across tokens) ends the stream and is not emitted, nor anything after it.

        Returns:
            A :class:`~aioexperts._model.text.TextStream` (async iterator of str, ``statistics``,
            ``token_ids``).
        """
        stream = _text.open_run(
            self,
            prompt,
            options=options,
            sampler=sampler,
            add_special=add_special,
            parse_special=parse_special,
            sampling={
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_k": top_k,
                "top_p": top_p,
                "min_p": min_p,
                "seed": seed,
                "stop": stop,
            },
            as_text=True,
        )
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

    async def _embed(self, ids: list[int]) -> np.ndarray:
        store, _, w, _ = self._started()
        if w.embedding is not None:
            return await run_in_worker(w.embedding.rows, ids)
        return await store.read_rows("token_embd.weight", ids)

    def _pre_block(
        self,
        layer: _Layer,
        resid: np.ndarray,
        f: np.ndarray | None,
        cache: dict[str, np.ndarray],
        start: int,
        capture: dict[str, np.ndarray] | None,
        route: Callable[[int, np.ndarray], Any] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, Any]:
        """Worker job: finish the previous block, norm, attention, residual, FFN norm, then (with
        ``route``, the runner's :meth:`MoERunner.route_in_job`) the MoE layer's routing."""
        t0 = time.perf_counter()
        hp = self._started()[3]
        il = layer.index
        x = block_input(hp, il, resid, f)
        if capture is not None and f is not None:
            capture[f"l_out-{il - 1}"] = x
        h = rms_norm(x, layer.attn_norm, hp.norm_eps)
        ffn_inp = after_attention(hp, il, x, layer.block.attention(h, cache, start))
        ffn_in = rms_norm(ffn_inp, layer.ffn_norm, hp.norm_eps)
        if capture is not None:
            capture[f"attn_norm-{il}"] = h
            capture[f"ffn_inp-{il}"] = ffn_inp
        t1 = time.perf_counter()
        self._counters.attention_seconds += t1 - t0
        if route is None:
            return ffn_inp, ffn_in, None
        routed = route(il, ffn_in)  # counted with the MoE layer, as when the runner routes
        self._counters.moe_seconds += time.perf_counter() - t1
        return ffn_inp, ffn_in, routed

    def _dense_ffn(self, layer: _Layer, x: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        assert layer.dense is not None
        y = layer.dense(x)
        self._counters.dense_ffn_seconds += time.perf_counter() - t0
        return y

    def _head(self, resid: np.ndarray, f: np.ndarray, capture: dict[str, np.ndarray] | None) -> np.ndarray:
        t0 = time.perf_counter()
        _, _, w, hp = self._started()
        x, h = head_input(hp, resid, f, w.output_norm)
        logits = scale_logits(hp, w.output(h))
        if capture is not None:
            capture[f"l_out-{hp.n_layer - 1}"] = x
            capture["result_norm"] = h
        self._counters.head_seconds += time.perf_counter() - t0
        return logits

    async def _forward(
        self,
        cache: KVCache,
        start: int,
        ids: list[int],
        *,
        all_logits: bool = True,
        capture: dict[str, np.ndarray] | None = None,
        step_of: ModelSequence | None = None,
    ) -> np.ndarray:
        """A forward pass of ``ids`` at ``start``; a one-token step of sequence ``step_of`` goes
        through the step batcher (cross-request batching, on while the runner's ``batch_wait`` is)."""
        runner = self._started()[1]
        batched = step_of is not None and runner.batching and len(ids) == 1 and capture is None
        if not batched or not _plain_moe(runner):
            return await self._forward_layers(cache, start, ids, all_logits, capture)
        assert cache.layers is not None, "KV cache freed"
        self._steps.wait = runner.batch_wait
        return await self._steps.submit(step_of, _StepCall(cache, DecodeRequest(cache.layers, start, ids[0])))

    async def _run_steps(self, calls: list[_StepCall]) -> list[np.ndarray | Exception]:
        """The step batcher's run: one call through the one-sequence path, more through
        :func:`~aioexperts._model.decode_batch.decode_rows` (the step raises as a whole only when
        every call would: the store closed, a read that failed)."""
        if len(calls) == 1:
            call = calls[0]
            try:
                logits = await self._forward_layers(call.cache, call.request.start, [call.request.token], True, None)
            except Exception as exc:
                return [exc]
            return [logits]
        return await decode_rows(self, [c.request for c in calls])

    async def _forward_layers(
        self,
        cache: KVCache,
        start: int,
        ids: list[int],
        all_logits: bool,
        capture: dict[str, np.ndarray] | None,
    ) -> np.ndarray:
        """One forward pass of one sequence."""
        _, runner, w, _ = self._started()
        resid = await self._embed(ids)
        f: np.ndarray | None = None
        # the runner's own moe(): route in the attention's job (one compute-pool hand-off fewer per layer)
        fused_route = capture is None and _plain_moe(runner)
        if fused_route:
            await runner.warmup()  # done at start(); cheap
            first = next((layer for layer in w.layers if layer.dense is None), None)
            if first is not None and len(ids) <= BATCH_MAX_ROWS:
                # the first MoE layer's experts, predicted from the token's embeddings (its FFN norm
                # of them) before any attention runs: nothing earlier in this step predicts them
                hp = self._started()[3]
                x = resid * np.float32(hp.embedding_scale) if hp.embedding_scale else resid
                runner.prefetch_first(first.index, rms_norm(x, first.ffn_norm, hp.norm_eps))
        for layer in w.layers:
            route = runner.route_in_job if fused_route and layer.dense is None else None
            ffn_inp, ffn_in, routed = await run_in_worker(
                self._pre_block, layer, resid, f, cache.layer(layer.index), start, capture, route
            )
            if layer.dense is None:
                t0 = time.perf_counter()
                if routed is not None:
                    f = await runner.execute(layer.index, routed)
                elif capture is None:
                    f = await runner.moe(layer.index, ffn_in)
                else:
                    result = await runner.moe_result(layer.index, ffn_in)
                    f = result.ffn_out
                    capture[f"topk-{layer.index}"] = result.ids
                self._counters.moe_seconds += time.perf_counter() - t0
            else:
                f = await run_in_worker(self._dense_ffn, layer, ffn_in)
            resid = ffn_inp
        assert f is not None
        if not all_logits and capture is None:
            resid, f = resid[-1:], f[-1:]
        logits = await run_in_worker(self._head, resid, f, capture)
        if len(ids) > 1:
            self._counters.tokens_prefilled += len(ids)
        else:
            self._counters.tokens_decoded += 1
        return logits if all_logits else logits[-1:]

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("started" if self._store is not None else "not started")
        return f"Model({self.path!r}, {state}, n_ctx={self._n_ctx})"


def _text_parts(
    path: str,
) -> tuple[Tokenizer | None, ChatTemplate | None, tuple[Exception | None, Exception | None]]:
    """Worker job of :meth:`Model.start`: the file's tokenizer and chat template, and what building each
    raised instead (no vocabulary or template in the file, no ``text`` extra, a malformed vocabulary):
    the properties :attr:`Model.tokenizer` and :attr:`Model.chat_template` raise that at first use, as
    they did when they built them there."""
    from aioexperts._text.chat import ChatTemplate
    from aioexperts._text.tokenizer import Tokenizer

    tokenizer: Tokenizer | None = None
    template: ChatTemplate | None = None
    errors: list[Exception | None] = [None, None]
    try:
        tokenizer = Tokenizer.from_gguf(path)
    except (AioExpertsError, OSError) as exc:
        errors[0] = exc
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
            ``granitemoe``, ``gpt-oss``, ``deepseek2``; docs/model.md).
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
    }
    return Model(path, config, store_options=options, runner=runner)
