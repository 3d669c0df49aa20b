"""One decode step of several sequences at once: cross-request batching of the whole forward pass.

When several sequences of one :class:`~aioexperts.Model` decode at the same moment, each in its own
task, their one-token steps are gathered one step at a time (:class:`~aioexperts._model.steps.StepBatcher`:
a lone sequence never waits) and run together by :func:`decode_rows`, block by block:

- the dense products of the attention (q, k, v, output) run once for every row, each weight block
  decoded once for several rows (:meth:`~aioexperts._model.weights.DenseMatrix.invariant`, split
  over the compute pool's workers); the attention itself runs per row on its own KV cache;
- the MoE layer reads each selected expert once and computes it once for every row that chose it
  (:meth:`aioexperts.MoERunner.execute_rows`);
- the output head is one product for every row.

Norms, residual adds (:mod:`aioexperts._model.residual`, as the one-sequence path), the top-k, the
shared expert, the slot-order sum and sampling stay per row,
and every product is batch-invariant, so each sequence gets bit for bit the logits it gets alone.
A row whose values turn non-finite fails alone (its error is its outcome); the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from aioexperts._compute.norms import rms_norm
from aioexperts._compute.pool import compute_pool
from aioexperts._errors import NonFiniteError
from aioexperts._format.architectures import ModelHParams
from aioexperts._model.blocks import BatchedAttentionBlock
from aioexperts._model.residual import (
    add_residual,
    after_attention,
    block_input,
    head_input,
    mixed_input,
    scale_logits,
)
from aioexperts._model.weights import invariant_products
from aioexperts._pipeline import run_in_worker


class StepModel(Protocol):
    """What a batched decode step needs of :class:`~aioexperts.Model` (its private parts)."""

    @property
    def hparams(self) -> ModelHParams: ...

    @property
    def _counters(self) -> Any: ...

    def _started(self) -> tuple[Any, Any, Any, ModelHParams]: ...

    async def _embed(self, ids: list[int]) -> np.ndarray: ...


__all__ = ("DecodeRequest", "decode_rows")


@dataclass(eq=False, slots=True)
class DecodeRequest:
    """One sequence's decode step: ``token`` at position ``start`` of the KV cache ``layers``.

    ``layers`` is the cache's list of per-block arrays, taken when the step is asked for, so a
    sequence closed while the step runs (its caller cancelled) frees nothing the step still writes.
    """

    layers: list[dict[str, np.ndarray]]
    start: int
    token: int


def _caught(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or the NonFiniteError it raised (that row's outcome)."""
    try:
        return fn(*args)
    except NonFiniteError as exc:
        return exc


def _pre_blocks(
    model: StepModel,
    layer: Any,
    resids: list[np.ndarray],
    fs: list[np.ndarray] | None,
    caches: list[Mapping[str, np.ndarray]],
    starts: list[int],
    route_rows: Any,
    token_ids: np.ndarray | None = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray, Any] | Exception], list[Any]]:
    """Worker job: :meth:`Model._pre_block` of every row, the attention's products and (with
    ``route_rows``, the runner's :meth:`~aioexperts.MoERunner.route_rows`) the routing shared.
    Returns per row ``(ffn_inp, ffn_in, routed)`` or its error, and the step's prefetch."""
    t0 = time.perf_counter()
    hp = model.hparams
    hc = model._started()[2].hyper
    il = layer.index
    n = len(resids)
    # a row whose input is not finite still goes through the products (its result is dropped)
    xs = [_caught(block_input, hp, il, resids[i], None if fs is None else fs[i], hc) for i in range(n)]
    failed = {i: x for i, x in enumerate(xs) if isinstance(x, Exception)}
    for i in failed:
        xs[i] = add_residual(resids[i], fs[i], hp) if hc is None else np.zeros_like(resids[i])  # type: ignore[index]
    h = np.concatenate([rms_norm(mixed_input(hc, il, "attn", x), layer.attn_norm, hp.norm_eps) for x in xs])
    pool = compute_pool()
    block = layer.block
    if isinstance(block, BatchedAttentionBlock):
        a = block.attention_rows(h, caches, starts, pool.n_threads)
    else:
        a = np.concatenate(pool.map(lambda i: block.attention(h[i : i + 1], caches[i], starts[i]), range(n)))
    t1 = time.perf_counter()

    out: list[tuple[np.ndarray, np.ndarray, Any] | Exception] = []
    for i in range(n):
        ffn_inp = failed.get(i) or _caught(after_attention, hp, il, xs[i], a[i : i + 1], hc)
        if isinstance(ffn_inp, Exception):
            out.append(ffn_inp)
        else:
            out.append((ffn_inp, rms_norm(mixed_input(hc, il, "ffn", ffn_inp), layer.ffn_norm, hp.norm_eps), None))
    prefetch: list[Any] = []
    ok = [i for i in range(n) if not isinstance(out[i], Exception)]
    if route_rows is not None and ok:
        try:
            ids = None if token_ids is None else token_ids[ok]
            routed, prefetch = route_rows(il, np.concatenate([out[i][1] for i in ok]), ids)  # type: ignore[index]
        except Exception as exc:
            routed = [exc] * len(ok)
        for i, r in zip(ok, routed, strict=True):
            out[i] = r if isinstance(r, Exception) else (out[i][0], out[i][1], r)  # type: ignore[index]
    model._counters.attention_seconds += t1 - t0
    model._counters.moe_seconds += time.perf_counter() - t1
    return out, prefetch


def _dense_rows(dense: Any, xs: list[np.ndarray]) -> list[np.ndarray]:
    """Worker job: a leading dense block's FFN of each row on its own (the one-row products)."""
    return compute_pool().map(dense, xs)


def _heads(model: StepModel, resids: list[np.ndarray], fs: list[np.ndarray]) -> list[np.ndarray | Exception]:
    """Worker job: :meth:`Model._head` of every row, the output product shared."""
    t0 = time.perf_counter()
    w, hp = model._started()[2], model.hparams
    out: list[np.ndarray | Exception | None] = [None] * len(resids)
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
    model._counters.head_seconds += time.perf_counter() - t0
    return out  # type: ignore[return-value]


async def decode_rows(model: StepModel, requests: Sequence[DecodeRequest]) -> list[np.ndarray | Exception]:
    """Run one decode token of each request together; ``(1, n_vocab)`` float32 logits per request,
    or the exception that request alone raised (module docstring).

    The caller (the model's step batcher) runs a single request through the model's own one-sequence
    path instead. A failure of the whole step (the store closed, a read error) raises.
    """
    _, runner, w, hp = model._started()
    n = len(requests)
    resid_all = await model._embed([r.token for r in requests])
    resids = [resid_all[i : i + 1] for i in range(n)]
    outcome: list[np.ndarray | Exception | None] = [None] * n
    live = list(range(n))
    await runner.warmup()
    first = next((layer for layer in w.layers if layer.dense is None), None)
    if first is not None:  # the first MoE layer's experts, predicted from each row's embeddings
        x = resid_all * np.float32(hp.embedding_scale) if hp.embedding_scale else resid_all
        for i in range(n):
            runner.prefetch_first(first.index, rms_norm(x[i : i + 1], first.ffn_norm, hp.norm_eps))
    fs: list[np.ndarray] | None = None
    for layer in w.layers:
        route_rows = runner.route_rows if layer.dense is None else None
        pre, prefetch = await run_in_worker(
            _pre_blocks,
            model,
            layer,
            [resids[i] for i in live],
            None if fs is None else [fs[i] for i in live],
            [requests[i].layers[layer.index] for i in live],
            [requests[i].start for i in live],
            route_rows,
            np.array([requests[i].token for i in live], dtype=np.int64),
        )
        ready: dict[int, tuple[np.ndarray, np.ndarray, Any]] = {}  # row -> (ffn_inp, ffn_in, routed)
        for i, got in zip(live, pre, strict=True):
            if isinstance(got, Exception):
                outcome[i] = got
            else:
                ready[i] = got
        live = list(ready)
        if not live:
            break
        t0 = time.perf_counter()
        new_f: list[np.ndarray | Exception]
        if layer.dense is None:
            new_f = await runner.execute_rows(layer.index, [ready[i][2] for i in live], prefetch)
            model._counters.moe_seconds += time.perf_counter() - t0
        else:
            new_f = [*await run_in_worker(_dense_rows, layer.dense, [ready[i][1] for i in live])]
            model._counters.dense_ffn_seconds += time.perf_counter() - t0
        fs_next: list[np.ndarray] = [np.empty(0, np.float32)] * n
        kept = []
        for i, f in zip(live, new_f, strict=True):
            if isinstance(f, Exception):
                outcome[i] = f
            else:
                fs_next[i] = f
                resids[i] = ready[i][0]
                kept.append(i)
        live, fs = kept, fs_next
        if not live:
            break
    if live and fs is not None:
        heads = await run_in_worker(_heads, model, [resids[i] for i in live], [fs[i] for i in live])
        for i, logits in zip(live, heads, strict=True):
            outcome[i] = logits
    model._counters.tokens_decoded += sum(not isinstance(o, Exception) for o in outcome)
    return outcome  # type: ignore[return-value]
