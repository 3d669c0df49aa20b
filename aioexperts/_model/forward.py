"""The one forward pass of the whole model, for 1..n rows: prefill, a one-token decode step, and the
batched decode step of several sequences.

Per block, as the graphs of llama.cpp's ``src/models/<arch>.cpp`` chain it::

    h       = rms_norm(x, attn_norm)                       # build_norm(LLM_NORM_RMS)
    ffn_inp = x + attention(h) * residual_scale            # granite.cpp build_layer_ffn scales
    f       = moe(rms_norm(ffn_inp, ffn_norm))             # the runner's executor, or the dense SwiGLU FFN
    x       = ffn_inp + f * residual_scale                 # of the leading dense blocks

then ``logits = output(rms_norm(x, output_norm)) / logit_scale``.

:meth:`ForwardPass.run` takes a batch of :class:`Rows` (one per sequence: its KV cache, its first
position, its token ids) and runs one loop over the blocks for all of them. Per block, one
compute-pool job runs the residual add of the previous block, the attention norm, the attention,
the FFN norm and the MoE layer's routing (:meth:`~aioexperts.MoERunner.route_in_job` for one
sequence, :meth:`~aioexperts.MoERunner.route_rows` for the rows of several); the MoE layer then
goes through :meth:`~aioexperts.MoERunner.execute_rows`, so every route from a token to the expert
kernels passes the runner's executor (local or sharded). With several sequences the dense products
run once for every row (each weight block decoded once, batch-invariant kernels), the attention per
row on its own KV cache, each selected expert is read once and computed once for every row that
chose it, and each sequence gets bit for bit the logits it gets alone. A row whose values turn
non-finite fails alone (its error is its outcome).

:class:`ForwardPass` also gathers the one-token decode steps of sequences that decode at the same
moment into one batched step (:class:`~aioexperts._model.steps.StepBatcher`, on while the runner's
``batch_wait`` is): the one batcher of concurrent sequences (:class:`aioexperts._batcher.Batcher`,
whose keyed-by-layer policy batches the MoE-only API's decode streams).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aioexperts._compute.norms import add_rms_norm, rms_norm
from aioexperts._compute.pool import compute_pool
from aioexperts._errors import FormatError, InvalidRequestError, NonFiniteError, UnsupportedTypeError
from aioexperts._format.architectures import ModelHParams
from aioexperts._format.model import GGUFModel
from aioexperts._model.blocks import BLOCKS, AttentionBlock, BatchedAttentionBlock
from aioexperts._model.hyper_weights import HyperConnections, read_hyper_connections
from aioexperts._model.residual import (
    add_residual,
    after_attention,
    block_input,
    head_input,
    mixed_input,
    scale_logits,
)
from aioexperts._model.steps import StepBatcher
from aioexperts._model.weights import DenseMatrix, TensorReader, invariant_products
from aioexperts._pipeline import run_in_worker
from aioexperts._router import Routing
from aioexperts._runner import BATCH_MAX_ROWS, MoERunner, ResidentPass
from aioexperts._store import ExpertStore

__all__ = (
    "DECODE_BATCH_MAX_CALLS",
    "DenseFFN",
    "ForwardCounters",
    "ForwardPass",
    "LayerWeights",
    "ModelWeights",
    "Rows",
    "load_weights",
)

DECODE_BATCH_MAX_CALLS = 16
"""Sequences one batched decode step takes at most; more open the next step. Its MoE layers go in
calls of ``BATCH_MAX_CALLS`` sequences (``_runner``)."""


@dataclass(frozen=True, slots=True, eq=False)
class DenseFFN:
    """A leading dense block's SwiGLU FFN (llama-graph.cpp ``build_ffn``, ``LLM_FFN_SILU, LLM_FFN_PAR``)."""

    gate: DenseMatrix
    up: DenseMatrix
    down: DenseMatrix

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``(n, n_embd)`` float32 -> ``(n, n_embd)`` float32."""
        g = self.gate(x)
        u = self.up(x)
        with np.errstate(over="ignore"):
            h = (g / (1.0 + np.exp(-g))) * u  # ggml_swiglu_split: silu(gate) * up
        return self.down(np.ascontiguousarray(h, dtype=np.float32))


@dataclass(frozen=True, slots=True, eq=False)
class LayerWeights:
    """One block's resident weights: norms, the attention block, the dense FFN (None: a MoE layer)."""

    index: int
    attn_norm: np.ndarray
    block: AttentionBlock
    ffn_norm: np.ndarray
    dense: DenseFFN | None


@dataclass(slots=True, eq=False)
class ModelWeights:
    """Every non-expert weight, resident; ``embedding`` None: read by rows through the store."""

    embedding: DenseMatrix | None
    output_norm: np.ndarray
    output: DenseMatrix
    layers: list[LayerWeights] = field(default_factory=list)
    n_bytes: int = 0
    hyper: HyperConnections | None = None  # deepseek4's hyper-connections (residual.py)

    def ggml_types(self) -> set[Any]:
        """The ggml types of the dense matrices (the kernels to warm up)."""
        types = {self.output.ggml_type}
        for layer in self.layers:
            types |= {m.ggml_type for m in vars(layer.block).values() if isinstance(m, DenseMatrix)}
            if layer.dense is not None:
                types |= {m.ggml_type for m in (layer.dense.gate, layer.dense.up, layer.dense.down)}
        return types


def load_weights(
    model: GGUFModel, hp: ModelHParams, moe_layers: frozenset[int], resident_embedding: int
) -> ModelWeights:
    """Read every non-expert tensor (blocking).

    Raises:
        FormatError: a required tensor is missing or has the wrong shape.
        UnsupportedTypeError: the architecture's attention block is not implemented, or a tensor's type.
    """
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
            dense = DenseFFN(
                reader.matrix(p + "ffn_gate.weight", (n_ff, n_embd) if n_ff else None),
                reader.matrix(p + "ffn_up.weight", (n_ff, n_embd) if n_ff else None),
                reader.matrix(p + "ffn_down.weight", (n_embd, n_ff) if n_ff else None),
            )
        layers.append(LayerWeights(il, attn_norm, block, ffn_norm, dense))
    hyper = read_hyper_connections(hp, reader) if hp.record.hyper_connections else None
    return ModelWeights(embedding, output_norm, output, layers, reader.n_bytes, hyper)


@dataclass(slots=True)
class ForwardCounters:
    """What the forward pass ran so far (the model's statistics read them)."""

    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    attention_seconds: float = 0.0
    dense_ffn_seconds: float = 0.0
    moe_seconds: float = 0.0
    head_seconds: float = 0.0
    sampling_seconds: float = 0.0


@dataclass(eq=False, slots=True)
class Rows:
    """One sequence's part of a forward pass: ``ids`` at positions ``start..start+len(ids)-1``.

    Attributes:
        layers: the sequence's KV cache, one dict of arrays per block (taken when the pass is asked
            for, so a sequence closed meanwhile frees nothing the pass still writes).
        start: the first position.
        ids: the token ids (checked by the caller).
        all_logits: logits of every row (False: of the last one).
        capture: a dict that receives the named intermediate tensors (``attn_norm-L``, ``ffn_inp-L``,
            ``topk-L``, ``l_out-L``, ``result_norm``), or None.
    """

    layers: list[dict[str, np.ndarray]]
    start: int
    ids: list[int]
    all_logits: bool = True
    capture: dict[str, np.ndarray] | None = None


#: per sequence after a block's first job: ``(ffn_inp, ffn_in, routing or None)`` or its error
_Pre = tuple[np.ndarray, np.ndarray, Routing | None] | Exception


@dataclass(frozen=True, slots=True)
class _Resume:
    """Where a held pass stopped: block ``layer`` (an index into the layers) has its attention and
    routing done (``pre``) and an expert to read."""

    layer: int
    pre: _Pre


HELD_MAX_ROWS = 64
"""Rows of one sequence up to which a pass whose experts are all resident runs as one compute job
(the held pass). A longer prompt goes layer by layer: its hand-offs cost little beside its compute,
and a cancellation or a close then waits for one layer, not for the whole prompt."""


def _caught(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or the NonFiniteError it raised (that row's outcome)."""
    try:
        return fn(*args)
    except NonFiniteError as exc:
        return exc


class ForwardPass:
    """The model's forward pass over its resident weights and its MoE runner (module docstring).

    Args:
        store: the started expert store (embedding rows of a table that is not resident).
        runner: the MoE runner; its executor computes every routed expert.
        weights: the resident weights.
        hparams: the whole-model hyper-parameters.
        batch_wait: the step batcher's window in seconds (0: off).
        counters: where to count (default: new ones).
    """

    def __init__(
        self,
        store: ExpertStore,
        runner: MoERunner,
        weights: ModelWeights,
        hparams: ModelHParams,
        batch_wait: float,
        counters: ForwardCounters | None = None,
    ) -> None:
        self.store = store
        self.runner = runner
        self.weights = weights
        self.hparams = hparams
        self.counters = counters if counters is not None else ForwardCounters()
        self.steps: StepBatcher[Rows, np.ndarray] = StepBatcher(self._run_steps, DECODE_BATCH_MAX_CALLS, batch_wait)

    # -- entry points ---------------------------------------------------------------------------

    async def __call__(self, rows: Rows, *, step_of: Hashable | None = None) -> np.ndarray:
        """A forward pass of one sequence's ``rows``: float32 logits ``(len(ids), n_vocab)``, or
        ``(1, n_vocab)`` when not ``rows.all_logits``.

        ``step_of``: the sequence (any hashable key); its one-token step joins the other sequences'
        decode step (cross-request batching, on while the runner's ``batch_wait`` is).

        Raises:
            NonFiniteError: NaN or inf in the residual stream or the logits.
            StoreClosedError, ExpertReadError, SlabExhaustedError: from the expert store.
            InvalidRequestError: from the router (a router output that is not finite).
        """
        if step_of is not None and self.runner.batching and len(rows.ids) == 1 and rows.capture is None:
            self.steps.wait = self.runner.batch_wait
            return await self.steps.submit(step_of, rows)
        (out,) = await self.run([rows])
        if isinstance(out, Exception):
            raise out
        return out

    async def _run_steps(self, batch: list[Rows]) -> list[np.ndarray | Exception]:
        return await self.run(batch)

    def forget(self, key: Hashable) -> None:
        """Drop sequence ``key`` from the step batcher (it closed)."""
        self.steps.forget(key)

    async def embed(self, ids: list[int]) -> np.ndarray:
        """``(len(ids), n_embd)`` float32 embedding rows (resident, or read through the store)."""
        w = self.weights
        if w.embedding is not None:
            return await run_in_worker(w.embedding.rows, ids)
        return await self.store.read_rows("token_embd.weight", ids)

    async def run(self, batch: Sequence[Rows]) -> list[np.ndarray | Exception]:
        """One forward pass of ``batch``: each sequence's logits, or the error that sequence alone
        raised. Several sequences must have one row each (a decode step).

        Raises:
            StoreClosedError, ExpertReadError, SlabExhaustedError: the pass failed as a whole.
        """
        runner, w, hp = self.runner, self.weights, self.hparams
        n = len(batch)
        assert n == 1 or all(len(r.ids) == 1 for r in batch), "several sequences run one row each"
        resid_all = await self.embed([t for r in batch for t in r.ids])
        bounds = np.cumsum([0, *(len(r.ids) for r in batch)])
        resids = [resid_all[bounds[i] : bounds[i + 1]] for i in range(n)]
        outcome: list[np.ndarray | Exception | None] = [None] * n
        live = list(range(n))
        await runner.warmup()  # done at start(); cheap
        first = next((layer for layer in w.layers if layer.dense is None), None)
        if first is not None:
            # the first MoE layer's experts, predicted from each sequence's embeddings (their FFN
            # norm) before any attention runs: nothing earlier in this step predicts them
            x = resid_all * np.float32(hp.embedding_scale) if hp.embedding_scale else resid_all
            for i in range(n):
                if bounds[i + 1] - bounds[i] <= BATCH_MAX_ROWS:
                    runner.prefetch_first(
                        first.index, rms_norm(x[bounds[i] : bounds[i + 1]], first.ffn_norm, hp.norm_eps)
                    )
        layers = w.layers
        start = 0
        pre: list[_Pre] | None = None
        prefetch: list[Any] | None = None
        if n == 1 and len(batch[0].ids) <= HELD_MAX_ROWS and batch[0].capture is None:
            # a slab with room for the whole model: the pass in one compute job while the experts it
            # routes to are resident, used where they are (no pin, await or hand-off per layer);
            # at the first layer with an expert to read, on through the executor from that layer
            with runner.hold_resident() as held:
                if held is not None:
                    # no read in flight: the pool's threads spin between the pass's fan-outs
                    held_out = await run_in_worker(self._held_pass, held, batch[0], resids[0], spin=True)
                    if not isinstance(held_out, _Resume):
                        outcome[0] = held_out
                        await self._finish(batch, outcome)
                        return outcome  # type: ignore[return-value]
                    start, pre = held_out.layer, [held_out.pre]
        if pre is None:
            pre, prefetch = await run_in_worker(self._pre_block, layers[0], list(batch), resids, None)
        assert pre is not None
        for k in range(start, len(layers)):
            layer = layers[k]
            ready: dict[int, tuple[np.ndarray, np.ndarray, Routing | None]] = {}
            for i, got in zip(live, pre, strict=True):
                if isinstance(got, Exception):
                    outcome[i] = got
                else:
                    ready[i] = got
            live = list(ready)
            if not live:
                break
            # the next block's first job (or the head) runs in this layer's last compute job
            after = functools.partial(
                self._after, layers[k + 1] if k + 1 < len(layers) else None, [batch[i] for i in live],
                [ready[i][0] for i in live],
            )  # fmt: skip
            t0 = time.perf_counter()
            new_f: list[np.ndarray | Exception]
            if layer.dense is None:
                routings = [ready[i][2] for i in live]
                new_f, nxt = await runner.execute_rows(layer.index, routings, prefetch, after)  # type: ignore[arg-type]
                self.counters.moe_seconds += time.perf_counter() - t0 - nxt[2]
                for i in live:
                    capture = batch[i].capture
                    routing = ready[i][2]
                    if capture is not None and routing is not None:
                        capture[f"topk-{layer.index}"] = routing.ids
            else:
                new_f, nxt = await run_in_worker(self._dense_then, layer.dense, [ready[i][1] for i in live], after)
                self.counters.dense_ffn_seconds += time.perf_counter() - t0 - nxt[2]
            for i, f in zip(live, new_f, strict=True):
                if isinstance(f, Exception):
                    outcome[i] = f
            kept, result, _ = nxt
            live = [live[j] for j in kept]
            if not live:
                break
            if k + 1 < len(layers):
                pre, prefetch = result
            else:
                for i, logits in zip(live, result, strict=True):
                    outcome[i] = logits
        await self._finish(batch, outcome)
        return outcome  # type: ignore[return-value]

    async def _finish(self, batch: Sequence[Rows], outcome: Sequence[np.ndarray | Exception | None]) -> None:
        """Count the pass; after a prefill of a model the slab holds whole, make every layer's
        expert table and decode step (:meth:`~aioexperts._executor.ResidentPass.prepare`), so that
        the first decode token makes none (about 15 ms of a 48-layer model's first token)."""
        self._count_outcomes(batch, outcome)
        runner = self.runner
        if len(batch) != 1 or len(batch[0].ids) < 2 or not isinstance(outcome[0], np.ndarray):
            return
        if not runner.store.model_resident():
            return
        with runner.hold_resident() as held:
            if held is not None:
                await run_in_worker(held.prepare, runner.residents, runner.store.hparams)

    def _count_outcomes(self, batch: Sequence[Rows], outcome: Sequence[np.ndarray | Exception | None]) -> None:
        for r, o in zip(batch, outcome, strict=True):
            if not isinstance(o, Exception):
                if len(r.ids) > 1:
                    self.counters.tokens_prefilled += len(r.ids)
                else:
                    self.counters.tokens_decoded += 1

    # -- the worker jobs ------------------------------------------------------------------------

    def _pre_block(
        self, layer: LayerWeights, rows: list[Rows], resids: list[np.ndarray], fs: list[np.ndarray] | None
    ) -> tuple[list[_Pre], list[Any] | None]:
        """Worker job: finish the previous block, norm, attention, residual, FFN norm, then (a MoE
        layer) the routing. Per sequence ``(ffn_inp, ffn_in, routing)`` or its error, and the
        step's prefetch (None: the routing's own)."""
        t0 = time.perf_counter()
        hp, hc = self.hparams, self.weights.hyper
        il = layer.index
        n = len(rows)
        route = layer.dense is None
        if n == 1:
            row = rows[0]
            scale = hp.residual_scale or 0.0
            # the residual add, its check and the next norm in one compiled call where it serves
            # (the same bits); else, or when not finite, the numpy steps (which raise the error)
            fused = None
            if fs is not None and hc is None:
                fused = add_rms_norm(resids[0], fs[0], scale, layer.attn_norm, hp.norm_eps)
            if fused is not None:
                x, h = fused
            else:
                x = _caught(block_input, hp, il, resids[0], None if fs is None else fs[0], hc)
                if isinstance(x, Exception):
                    return [x], None
                h = rms_norm(mixed_input(hc, il, "attn", x), layer.attn_norm, hp.norm_eps)
            if row.capture is not None and fs is not None:
                row.capture[f"l_out-{il - 1}"] = x
            a = layer.block.attention(h, row.layers[il], row.start)
            fused = None if hc is not None else add_rms_norm(x, a, scale, layer.ffn_norm, hp.norm_eps)
            if fused is not None:
                ffn_inp, ffn_in = fused
            else:
                ffn_inp = _caught(after_attention, hp, il, x, a, hc)
                if isinstance(ffn_inp, Exception):
                    return [ffn_inp], None
                ffn_in = rms_norm(mixed_input(hc, il, "ffn", ffn_inp), layer.ffn_norm, hp.norm_eps)
            if row.capture is not None:
                row.capture[f"attn_norm-{il}"] = h
                row.capture[f"ffn_inp-{il}"] = ffn_inp
            t1 = time.perf_counter()
            self.counters.attention_seconds += t1 - t0
            if not route:
                return [(ffn_inp, ffn_in, None)], None
            # counted with the MoE layer; the token ids route the hash-routed layers (deepseek4), and
            # only those: a model without any is routed without them (no array to make and check)
            ids = np.asarray(row.ids, dtype=np.int64) if hp.moe.n_hash_layers else None
            routing = self.runner.route_in_job(il, ffn_in, token_ids=ids)
            self.counters.moe_seconds += time.perf_counter() - t1
            return [(ffn_inp, ffn_in, routing)], None

        # several sequences, one row each: a row whose input is not finite still goes through the
        # products (its result is dropped)
        xs = [_caught(block_input, hp, il, resids[i], None if fs is None else fs[i], hc) for i in range(n)]
        failed = {i: x for i, x in enumerate(xs) if isinstance(x, Exception)}
        for i in failed:
            xs[i] = add_residual(resids[i], fs[i], hp) if hc is None else np.zeros_like(resids[i])  # type: ignore[index]
        h = np.concatenate([rms_norm(mixed_input(hc, il, "attn", x), layer.attn_norm, hp.norm_eps) for x in xs])
        pool = compute_pool()
        block = layer.block
        caches = [r.layers[il] for r in rows]
        starts = [r.start for r in rows]
        if isinstance(block, BatchedAttentionBlock):
            a = block.attention_rows(h, caches, starts, pool.n_threads)
        else:
            a = np.concatenate(pool.map(lambda i: block.attention(h[i : i + 1], caches[i], starts[i]), range(n)))
        t1 = time.perf_counter()
        out: list[_Pre] = []
        for i in range(n):
            inp = failed.get(i) or _caught(after_attention, hp, il, xs[i], a[i : i + 1], hc)
            if isinstance(inp, Exception):
                out.append(inp)
            else:
                out.append((inp, rms_norm(mixed_input(hc, il, "ffn", inp), layer.ffn_norm, hp.norm_eps), None))
        prefetch: list[Any] = []
        ok = [i for i in range(n) if not isinstance(out[i], Exception)]
        if route and ok:
            try:
                ids = np.array([rows[i].ids[0] for i in ok], dtype=np.int64)
                x_ok = np.concatenate([out[i][1] for i in ok])  # type: ignore[index]
                routed, prefetch = self.runner.route_rows(il, x_ok, ids)
            except Exception as exc:
                routed = [exc] * len(ok)
            for i, r in zip(ok, routed, strict=True):
                out[i] = r if isinstance(r, Exception) else (out[i][0], out[i][1], r)  # type: ignore[index]
        self.counters.attention_seconds += t1 - t0
        self.counters.moe_seconds += time.perf_counter() - t1
        return out, prefetch

    def _held_pass(self, held: ResidentPass, row: Rows, resid: np.ndarray) -> np.ndarray | Exception | _Resume:
        """Worker job: every block of one sequence's rows, then the head, with the resident experts
        held in memory (:meth:`MoERunner.hold_resident`): :meth:`_pre_block`, the FFN and the head as
        the layer-by-layer pass runs them, so the numbers are the same. Its logits, or its error, or
        where to go on through the executor (the first MoE layer that chose an expert to read)."""
        ffn_inp, f = resid, None
        counters = self.counters
        for k, layer in enumerate(self.weights.layers):
            (got,), _ = self._pre_block(layer, [row], [ffn_inp], None if f is None else [f])
            if isinstance(got, Exception):
                return got
            ffn_inp, ffn_in, routing = got
            t0 = time.perf_counter()
            if layer.dense is not None:
                f = layer.dense(ffn_in)
                counters.dense_ffn_seconds += time.perf_counter() - t0
                continue
            assert routing is not None
            try:
                f = held.moe(layer.index, routing)
            except InvalidRequestError as exc:  # not finite: this sequence's error, as execute_rows'
                return exc
            finally:
                counters.moe_seconds += time.perf_counter() - t0
            if f is None:
                return _Resume(k, got)
        assert f is not None
        return self._heads([row], [ffn_inp], [f])[0]

    def _after(
        self, nxt: LayerWeights | None, rows: list[Rows], ffn_inps: list[np.ndarray], fs: list[np.ndarray | Exception]
    ) -> tuple[list[int], Any, float]:
        """In a layer's last compute job: the next block's first job (:meth:`_pre_block`) or, after
        the last block, the head (:meth:`_heads`) of the sequences whose FFN output ``fs`` came
        out. Returns their indices, that job's result and its seconds."""
        t0 = time.perf_counter()
        kept = [j for j, f in enumerate(fs) if not isinstance(f, Exception)]
        result: Any = None
        if kept:
            args = ([rows[j] for j in kept], [ffn_inps[j] for j in kept], [fs[j] for j in kept])
            result = self._heads(*args) if nxt is None else self._pre_block(nxt, *args)  # type: ignore[arg-type]
        return kept, result, time.perf_counter() - t0

    @staticmethod
    def _dense_then(
        dense: DenseFFN, xs: list[np.ndarray], then: Callable[[list[np.ndarray | Exception]], Any]
    ) -> tuple[list[np.ndarray | Exception], Any]:
        """Worker job: a leading dense block's FFN of each sequence's rows, then ``then`` of them."""
        outs: list[np.ndarray | Exception] = [dense(xs[0])] if len(xs) == 1 else [*compute_pool().map(dense, xs)]
        return outs, then(outs)

    def _heads(self, rows: list[Rows], resids: list[np.ndarray], fs: list[np.ndarray]) -> list[np.ndarray | Exception]:
        """Worker job: output norm and head of each sequence (one product for several)."""
        t0 = time.perf_counter()
        w, hp = self.weights, self.hparams
        out: list[np.ndarray | Exception | None] = [None] * len(rows)
        if len(rows) == 1:
            row, resid, f = rows[0], resids[0], fs[0]
            if not row.all_logits and row.capture is None:
                resid, f = resid[-1:], f[-1:]
            got = _caught(head_input, hp, resid, f, w.output_norm, w.hyper)
            if isinstance(got, Exception):
                out[0] = got
            else:
                x, h = got
                logits = _caught(scale_logits, hp, w.output(h))
                if row.capture is not None:
                    row.capture[f"l_out-{hp.n_layer - 1}"] = x
                    row.capture["result_norm"] = h
                out[0] = logits if isinstance(logits, Exception) or row.all_logits else logits[-1:]
        else:
            hs: list[np.ndarray] = []
            live: list[int] = []
            for i, (resid, f) in enumerate(zip(resids, fs, strict=True)):
                got = _caught(head_input, hp, resid, f, w.output_norm, w.hyper)
                if isinstance(got, Exception):
                    out[i] = got
                    continue
                hs.append(got[1])
                live.append(i)
            if live:
                (logits,) = invariant_products([(w.output, np.concatenate(hs))], compute_pool().n_threads)
                for j, i in enumerate(live):
                    out[i] = _caught(scale_logits, hp, logits[j : j + 1])
        self.counters.head_seconds += time.perf_counter() - t0
        return out  # type: ignore[return-value]
