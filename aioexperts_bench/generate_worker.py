"""One engine run of ``aioexperts-bench --mode generate``, in a process of its own (inside the cgroup).

Run as ``python -m aioexperts_bench.generate_worker CONFIG_JSON``. The same protocol for every
engine: load the model, prefill the prompt in one batch (its time is the prefill and the time to
first token), then evaluate the decode ids one at a time (teacher-forced: the same tokens for every
engine), taking the greedy token (argmax of the logits) after the prompt and after every step.
Each phase prints one JSON line on stdout as soon as it ends, so a run killed by the OOM killer or
the timeout still reports what it did; the last line has ``"phase": "done"``.

With ``cfg["warm_prefill"]`` (the bench sets it when there is no memory limit) every engine first
prefills the prompt once and throws it away (``"phase": "cold_prefill"``: the cold start, with the
engine's reads of the weights), so that the measured prefill and decode are steady states: the
slab holds the experts, llama.cpp's mmap is in the page cache.

Engines: ``aioexperts`` (:func:`aioexperts.load`, slab sized from the memory limit),
``aioexperts-int8`` (the same with the int8 kernels; only when asked for), ``llama.cpp``
(llama-cpp-python with its defaults: mmap, CPU repack of the weights) and ``llama.cpp-norepack``
(the same with ``use_extra_bufts = False``: the weights stay in the mmap).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ("DEFAULT_ENGINES", "ENGINES", "LLAMA_ENGINES", "main", "process_counters")

LLAMA_ENGINES = ("llama.cpp", "llama.cpp-norepack")
#: ``aioexperts-int8``: the same with ``set_precision("int8")`` (activations quantized to 8 bits
#: before the Q8_0/Q4_K/Q6_K products, as llama.cpp does; not the default: see docs/executor.md)
#: ``aioexperts-tier``: the same with the low-precision miss tier (``cfg["miss_tier"]``: the sidecar's
#: path and the MissTier policy; issue 36)
ENGINES = ("aioexperts", "aioexperts-int8", "aioexperts-tier", *LLAMA_ENGINES)
DEFAULT_ENGINES = ("aioexperts", *LLAMA_ENGINES)


def process_counters() -> dict[str, int]:
    """Major faults, peak RSS and bytes this process had read from the block device so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    read_bytes = 0
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "read_bytes":
                    read_bytes = int(value)
    except OSError:
        pass
    return {"major_faults": usage.ru_majflt, "peak_rss_bytes": usage.ru_maxrss * 1024, "device_read_bytes": read_bytes}


def anon_memory(path: str = "/proc/self/smaps_rollup") -> dict[str, int] | None:
    """This process's anonymous bytes and those on transparent huge pages (``smaps_rollup``'s
    ``Anonymous`` and ``AnonHugePages``), or None where the file cannot be read: whether the slab
    and the dense weights got 2 MiB pages in a run (a run after another engine may find memory
    fragmented)."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Anonymous", "AnonHugePages"):
                    found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(found) != 2:
        return None
    return {"anon_bytes": found["Anonymous"], "anon_huge_bytes": found["AnonHugePages"]}


def read_sources(before: Any, after: Any, stall0: float, stall1: float) -> dict[str, Any]:
    """Where the decode tokens' experts came from and where the pass waited, between two store
    snapshots (``StoreStatistics``) and the model's stall seconds at each (issue 36's statistics)."""
    busy = after.device_busy_seconds - before.device_busy_seconds
    read = after.bytes_read - before.bytes_read
    keys = ("requests", "cached_hits", "prefetched_in_time", "prefetched_late", "demand_misses", "low_tier_misses")
    tier_keys = ("low_tier_prefetch_hits", "low_tier_prefetches", "tier_upgrades", "tier_upgrades_deferred")
    out: dict[str, Any] = {key: getattr(after, key) - getattr(before, key) for key in (*keys, *tier_keys)}
    out["stall_seconds"] = stall1 - stall0
    out["device_busy_seconds"] = busy
    out["device_bytes_per_second"] = read / busy if busy > 0 else None
    return out


def _emit(phase: str, **fields: Any) -> None:
    print(json.dumps({"phase": phase, "t": time.time(), **process_counters(), **fields}, allow_nan=False), flush=True)


def _decode_loop(step: Callable[[int], np.ndarray], ids: Sequence[int]) -> None:
    """Evaluate ``ids`` one at a time; emit one line per token (latency and greedy token)."""
    for i, token in enumerate(ids):
        t0 = time.perf_counter()
        logits = step(token)
        greedy = int(np.argmax(logits))
        _emit("token", index=i, seconds=time.perf_counter() - t0, greedy=greedy)


async def _run_aioexperts(cfg: dict[str, Any]) -> None:
    import aioexperts

    t0 = time.perf_counter()
    tier = cfg.get("miss_tier") if cfg["engine"] == "aioexperts-tier" else None
    miss_tier = aioexperts.MissTier(**tier) if tier else None
    spec = cfg.get("speculative")
    prefetch = None if spec is None else aioexperts.PrefetchOptions(speculative=spec)
    async with aioexperts.load(
        cfg["model"], n_ctx=cfg["n_ctx"], record_trace=True, miss_tier=miss_tier, prefetch=prefetch
    ) as model:
        store = model.store
        budget = model.slab_budget
        st = store.statistics()
        _emit(
            "loaded",
            seconds=time.perf_counter() - t0,
            slab_bytes=st.n_slots * st.slot_bytes,
            n_slots=st.n_slots,
            slot_bytes=st.slot_bytes,
            experts_total=store.layout.n_experts_total,
            slab_budget=str(budget) if budget is not None else None,
            memory_limit_source=budget.limit.source if budget is not None else None,
            backend=st.backend,
            fallback_reason=st.fallback_reason,
            backend_features=st.backend_features,
        )
        if cfg.get("warm_prefill"):
            async with model.sequence() as warm:
                t1 = time.perf_counter()
                await warm.forward(cfg["prompt"], all_logits=False)
                _emit("cold_prefill", seconds=time.perf_counter() - t1, n_tokens=len(cfg["prompt"]))
        async with model.sequence() as seq:
            t1 = time.perf_counter()
            logits = await seq.forward(cfg["prompt"], all_logits=False)
            first = int(np.argmax(logits[-1]))
            _emit("prefill", seconds=time.perf_counter() - t1, greedy=first, n_tokens=len(cfg["prompt"]))
            timeline = _start_timeline(model, cfg)
            from aioexperts._compute.pool import compute_pool

            pool = compute_pool()
            before, split0, pool0 = store.statistics(), model.statistics(), pool.statistics()
            for i, token in enumerate(cfg["decode"]):
                t2 = time.perf_counter()
                if timeline is not None:
                    timeline.begin_token()
                out = await seq.forward([token], all_logits=False)
                if timeline is not None:
                    timeline.end_token()
                greedy = int(np.argmax(out[-1]))
                _emit("token", index=i, seconds=time.perf_counter() - t2, greedy=greedy)
            after, split1, pool1 = store.statistics(), model.statistics(), pool.statistics()
            if timeline is not None:
                model.runner.record_timeline(None)
                _write_timeline(timeline, model, cfg["timeline"])
        n_decode = len(cfg["decode"])
        trace = model.runner.routing_trace().ids[-n_decode:] if n_decode else None
        distinct = (
            [int(len(np.unique(trace[:, i][trace[:, i] >= 0]))) for i in range(trace.shape[1])]
            if trace is not None
            else []
        )
        requests = after.requests - before.requests
        parts = {
            name: getattr(split1, f"{name}_seconds") - getattr(split0, f"{name}_seconds")
            for name in ("attention", "dense_ffn", "moe", "head", "sampling")
        }
        _emit(
            "done",
            hit_rate=(after.hits - before.hits) / requests if requests else None,
            expert_bytes_read=after.bytes_read - before.bytes_read,
            read_sources=read_sources(before, after, split0.stall_seconds, split1.stall_seconds),
            distinct_experts_per_layer=distinct,
            seconds_per_part=parts,
            fan_out_seconds=pool1.fan_out_seconds - pool0.fan_out_seconds,
            memory=anon_memory(),
        )


def _start_timeline(model: Any, cfg: dict[str, Any]) -> Any:
    """With ``cfg["timeline"]`` (``--mode timeline``): a Timeline recording the decode tokens, else None."""
    if not cfg.get("timeline"):
        return None
    import aioexperts

    n_layers = len(model.store.layout.layers)
    n = len(cfg["decode"])
    # reads: every expert of every layer, prefetches included, with room; steps: one per layer and token
    timeline = aioexperts.Timeline(
        max_reads=max(1 << 12, 4 * n * n_layers * model.store.layout.n_expert_used),
        max_steps=max(1 << 8, 2 * n * n_layers),
        max_tokens=max(1, n),
    )
    model.runner.record_timeline(timeline)
    return timeline


def _write_timeline(timeline: Any, model: Any, path: str) -> None:
    """The recorded decode tokens as JSON columns (``Timeline.as_dict``) with the MoE layers, to ``path``."""
    from aioexperts._json import dumps

    data = timeline.as_dict()
    data["layers"] = [int(x) for x in model.store.layout.layers]
    data["backend"] = model.store.statistics().backend
    with open(path, "w") as f:
        f.write(dumps(data) + "\n")


def _run_llama(cfg: dict[str, Any], repack: bool) -> None:
    import llama_cpp  # type: ignore[import-not-found,unused-ignore]
    import llama_cpp.llama_cpp as bindings  # type: ignore[import-not-found,unused-ignore]

    if not repack:  # the weights stay in the mmap (llama-cli --no-repack)
        default_params = bindings.llama_model_default_params

        def no_repack() -> Any:
            params = default_params()
            params.use_extra_bufts = False
            return params

        # Llama.__init__ reads the defaults through the bindings module, not the package
        bindings.llama_model_default_params = no_repack
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=cfg["model"],
        n_ctx=cfg["n_ctx"],
        n_batch=max(len(cfg["prompt"]), 1),
        n_ubatch=max(len(cfg["prompt"]), 1),
        n_threads=cfg["threads"],
        n_threads_batch=cfg["threads"],
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    extra_bufts = bool(llm.model_params.use_extra_bufts)
    if extra_bufts != repack:
        print(f"llama.cpp loaded with use_extra_bufts={extra_bufts}, wanted {repack}", file=sys.stderr)
        sys.exit(3)
    _emit(
        "loaded",
        seconds=time.perf_counter() - t0,
        version=getattr(llama_cpp, "__version__", None),
        repack=extra_bufts,
        load_mode=int(llm.model_params.load_mode),
    )

    def logits() -> np.ndarray:
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).copy()  # type: ignore[no-untyped-call,unused-ignore]

    if cfg.get("warm_prefill"):
        t1 = time.perf_counter()
        llm.eval(cfg["prompt"])
        _emit("cold_prefill", seconds=time.perf_counter() - t1, n_tokens=len(cfg["prompt"]))
        # n_tokens = 0: the next eval removes the cached positions (kv_cache_seq_rm) first
        llm.reset()  # type: ignore[no-untyped-call,unused-ignore]
    t1 = time.perf_counter()
    llm.eval(cfg["prompt"])
    first = int(np.argmax(logits()))
    _emit("prefill", seconds=time.perf_counter() - t1, greedy=first, n_tokens=len(cfg["prompt"]))

    def step(token: int) -> np.ndarray:
        llm.eval([token])
        return logits()

    _decode_loop(step, cfg["decode"])
    _emit("done")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the engine the JSON config (``argv[0]``) names; 2 on a bad config."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m aioexperts_bench.generate_worker CONFIG_JSON", file=sys.stderr)
        return 2
    cfg = json.loads(args[0])
    engine = cfg.get("engine")
    _emit("start", engine=engine, pid=os.getpid())
    if engine in ("aioexperts", "aioexperts-int8", "aioexperts-tier"):
        import anyio

        if engine == "aioexperts-int8":
            from aioexperts._compute.fused import set_precision

            set_precision("int8")
        anyio.run(_run_aioexperts, cfg)
    elif engine in LLAMA_ENGINES:
        _run_llama(cfg, repack=engine == "llama.cpp")
    else:
        print(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
