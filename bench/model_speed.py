"""Whole-model speed: decode compute against expert I/O, prefill against decode, decode at slab sizes.

Usage::

    python bench/model_speed.py --layers 48 --tokens 8 --rounds 3 --out docs/results/model_speed-48l.json
    python bench/model_speed.py --render docs/results/model_speed-48l.json docs/model.md
    python bench/model_speed.py --model dsv4-flash --tokens 8 --rounds 3 --out docs/results/model_speed-dsv4-4l.json
    python bench/model_speed.py --render docs/results/model_speed-dsv4-4l.json docs/model.md

The model is the built-in full model (``aioexperts.testing.ensure_full_model``: Qwen3-30B-A3B geometry,
Q4_K experts, written once into the user cache; ``--layers``, default 48), or with ``--model dsv4-flash``
the built-in DeepSeek-V4-Flash-geometry model (``aioexperts.testing.ensure_dsv4_model``: ``deepseek4``,
256 Q2_K experts per layer, top-6; ``--layers``, default 4, about 9.1 GB), or ``--model FILE``. Greedy
decoding on 2 cores. Each of ``--rounds``
interleaved rounds runs, in this order:

1. resident decode: ``--tokens`` greedy tokens after an 8-token prompt, every expert resident (a
   slab of all experts, warmed before round 1), timed per step (forward + sampling), with the
   model's time split (attention, dense FFN, MoE, head, sampling, other);
2. cold I/O: the page cache of the model file dropped, then the very experts those tokens routed
   to, read layer after layer through a store of ``n_expert_used`` slots (0 % hits);
3. resident prefill of a ``--prompt``-token prompt.

Per round: ``compute_io_ratio`` = decode ms per token / cold I/O ms per token (target <= 0.5) and
``prefill_over_decode`` = prefill tokens/s / decode tokens/s (target >= 5). Each figure is the
median (min-max) of the per-round values. Then, once each, decode tokens/s at slabs of 10 %, 25 %
and 50 % of the experts (page cache dropped, slab empty at the start), with hit rates and bytes
read per token.

``--render`` replaces the region of the results' architecture: ``<!-- bench:model_speed -->`` for
``qwen3moe``, ``<!-- bench:model_speed-ARCH -->`` for another (``model_speed-deepseek4``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import one_line_error, replace_region, write_results  # noqa: E402

import aioexperts  # noqa: E402
from aioexperts.backends import liburing_unusable_reason  # noqa: E402
from aioexperts.testing import ensure_dsv4_model, ensure_full_model, print_progress  # noqa: E402
from aioexperts_bench import DROP_METHOD, drop_page_cache, machine_facts, machine_label, probe_host_cache  # noqa: E402

IO = aioexperts.IOOptions(backend="auto")  # io_uring when it runs here, else the thread pool
SPLIT = ("attention", "dense_ffn", "moe", "head", "sampling")
TARGETS = {"compute_io_ratio": ("<=", 0.5), "prefill_over_decode": (">=", 5.0)}
SLAB_FRACTIONS = (0.10, 0.25, 0.50)
DSV4_NAME = "dsv4-flash"  # --model dsv4-flash: the built-in DeepSeek-V4-geometry model

Routing = list[list[tuple[int, list[int]]]]  # per decoded token: (layer, expert ids) in layer order


def record_routing(store: aioexperts.ExpertStore) -> tuple[Routing, Callable[[], None]]:
    """Record every ``store.experts(layer, ids)`` call (the pipeline's one per layer) into a list.

    Returns the list (a new inner list starts at each ``mark()``) and ``mark``.
    """
    calls: Routing = [[]]
    original = store.experts

    def recording(layer: int, ids: Any, **kwargs: Any) -> AbstractAsyncContextManager[Any]:
        ids = [int(i) for i in ids]
        calls[-1].append((layer, ids))
        return original(layer, ids, **kwargs)

    store.experts = recording  # type: ignore[method-assign]
    return calls, lambda: calls.append([])


async def resident_decode(
    model: aioexperts.Model, prompt: list[int], n: int, mark: Callable[[], None] | None = None
) -> dict[str, Any]:
    """``n`` greedy decode steps after ``prompt``: per-step ms, the split per token, hit rate, tokens."""
    steps, tokens = [], []
    async with model.sequence() as seq:
        gen = seq.generate(prompt, max_tokens=n + 1)
        tokens.append(await gen.__anext__())  # prefill of the prompt + first sample: not timed
        before, st0, ru0 = model.statistics(), model.store.statistics(), model.runner.statistics()
        for _ in range(n):
            if mark is not None:
                mark()
            t0 = time.perf_counter()
            tokens.append(await gen.__anext__())  # forward of the last token + sampling
            steps.append((time.perf_counter() - t0) * 1e3)
        after, st1, ru1 = model.statistics(), model.store.statistics(), model.runner.statistics()
    split = {
        f"{name}_ms": (getattr(after, f"{name}_seconds") - getattr(before, f"{name}_seconds")) * 1e3 / n
        for name in SPLIT
    }
    split["other_ms"] = sum(steps) / n - sum(split.values())  # embedding, residual adds, the event loop
    # inside moe_ms: the expert kernels' worker time and the wait for experts (the rest is routing, pinning)
    split["moe_expert_compute_ms"] = (ru1.compute_seconds - ru0.compute_seconds) * 1e3 / n
    split["moe_io_wait_ms"] = (ru1.io_wait_seconds - ru0.io_wait_seconds) * 1e3 / n
    return {
        "decode_ms_per_token": sum(steps) / n,
        "step_ms": steps,
        "split": split,
        "hit_rate": (st1.hits - st0.hits) / max(1, st1.requests - st0.requests),
        "tokens": tokens,
    }


async def cold_io(path: Path, routing: Routing, k: int) -> dict[str, Any]:
    """Read each token's experts, layer after layer, from a cold store of ``k`` slots (0 % hits)."""
    drop_page_cache([str(path)])
    per_token = []
    async with aioexperts.open(path, slots=k, io=IO) as store:
        st0 = store.statistics()
        for token in routing:
            t0 = time.perf_counter()
            for layer, ids in token:
                async with store.experts(layer, ids):
                    pass
            per_token.append((time.perf_counter() - t0) * 1e3)
        st1 = store.statistics()
    return {
        "io_ms_per_token": sum(per_token) / len(per_token),
        "token_ms": per_token,
        "hit_rate": (st1.hits - st0.hits) / max(1, st1.requests - st0.requests),
        "bytes_read_per_token": (st1.bytes_read - st0.bytes_read) / len(per_token),
    }


async def slab_decode(path: Path, slots: int, prompt: list[int], n: int, n_ctx: int) -> dict[str, Any]:
    """Greedy decode of ``n`` tokens after ``prompt`` with ``slots`` slots, cold page cache, empty slab."""
    drop_page_cache([str(path)])
    async with aioexperts.load(path, slots=slots, io=IO, n_ctx=n_ctx) as model, model.sequence() as seq:
        gen = seq.generate(prompt, max_tokens=n + 1)
        await gen.__anext__()  # the prompt: not counted
        st0 = model.store.statistics()
        t0 = time.perf_counter()
        for _ in range(n):
            await gen.__anext__()
        seconds = time.perf_counter() - t0
        st1 = model.store.statistics()
    return {
        "slots": slots,
        "tokens_per_second": n / seconds,
        "hit_rate": (st1.hits - st0.hits) / max(1, st1.requests - st0.requests),
        "bytes_read_per_token": (st1.bytes_read - st0.bytes_read) / n,
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def verdict(name: str, value: float) -> str:
    op, target = TARGETS[name]
    met = value <= target if op == "<=" else value >= target
    return "met" if met else "MISSED"


def fmt(s: dict[str, float], spec: str = ".2f") -> str:
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


async def main(args: argparse.Namespace) -> None:
    started = time.time()
    command = "python bench/model_speed.py " + " ".join(sys.argv[1:])
    path = model_path(args)
    logging.getLogger("aioexperts").setLevel(logging.ERROR)  # the backend fallback is printed once, below
    facts = machine_facts(str(path))
    host_cache = probe_host_cache(str(path))  # is a 'cold' read served by the host's memory?
    rng = np.random.default_rng(0)
    n_ctx = args.prompt + args.tokens + 16
    rounds: list[dict[str, Any]] = []
    architecture = str(aioexperts.open_model(path).architecture)
    async with aioexperts.open(path, slots=1, io=IO) as probe:
        layers = probe.layout.layers
        k, per_layer = probe.layout.n_expert_used, max(m.n_experts for m in layers.values())
    total = sum(m.n_experts for m in layers.values())
    shape = f"{len(layers)} MoE layers, {per_layer} experts, top-{k}"
    print(f"model: {path.name} ({architecture}): {shape}; {machine_label(facts)}")

    async with aioexperts.load(path, slots=total, io=IO, n_ctx=n_ctx) as model:
        prompt = rng.integers(0, model.n_vocab, size=args.prompt).tolist()
        short = prompt[:8]
        store_facts = model.store.statistics()
        why = store_facts.fallback_reason or ""
        print(f"reads: backend {store_facts.backend}, O_DIRECT {store_facts.direct_io} {why}")
        t0 = time.perf_counter()
        routing, mark = record_routing(model.store)
        # layer by layer while recording: the held pass takes resident experts without store.experts()
        model.runner.hold_resident = lambda: contextlib.nullcontext(None)  # type: ignore[method-assign]
        warm = await resident_decode(model, short, args.tokens, mark)  # loads these tokens' experts, records them
        del model.store.experts, model.runner.hold_resident  # the instance attributes go
        routing = routing[1:]  # the first list is the prompt's prefill: one per decoded token after it
        for layer, moe in layers.items():  # then every expert, read only (no compute)
            async with model.store.experts(layer, range(moe.n_experts)):
                pass
        await model.logits(prompt[:32])  # and the batched code paths once
        print(f"warm-up (every expert read once): {time.perf_counter() - t0:.0f} s")
        for r in range(args.rounds):
            dec = await resident_decode(model, short, args.tokens)
            assert dec["tokens"] == warm["tokens"], "greedy decoding is not deterministic"
            io = await cold_io(path, routing, k)
            t0 = time.perf_counter()
            await model.logits(prompt)
            prefill_s = time.perf_counter() - t0
            row = {
                "round": r,
                "load_average": os.getloadavg(),
                "decode_ms_per_token": dec["decode_ms_per_token"],
                "decode_step_ms": dec["step_ms"],
                "decode_hit_rate": dec["hit_rate"],
                "split_ms": dec["split"],
                "cold_io_ms_per_token": io["io_ms_per_token"],
                "cold_io_token_ms": io["token_ms"],
                "cold_io_hit_rate": io["hit_rate"],
                "cold_io_bytes_per_token": io["bytes_read_per_token"],
                "compute_io_ratio": dec["decode_ms_per_token"] / io["io_ms_per_token"],
                "prefill_tokens_per_second": args.prompt / prefill_s,
                "decode_tokens_per_second": 1e3 / dec["decode_ms_per_token"],
            }
            row["prefill_over_decode"] = row["prefill_tokens_per_second"] / row["decode_tokens_per_second"]
            rounds.append(row)
            print(
                f"round {r}: decode {row['decode_ms_per_token']:.0f} ms/token (hits {dec['hit_rate']:.2f}), "
                f"cold I/O {row['cold_io_ms_per_token']:.0f} ms/token (hits {io['hit_rate']:.2f}), "
                f"ratio {row['compute_io_ratio']:.2f}; prefill {row['prefill_tokens_per_second']:.1f} tok/s, "
                f"{row['prefill_over_decode']:.1f}x decode; load {row['load_average'][0]:.1f}",
                flush=True,
            )

    slabs = []
    for frac in SLAB_FRACTIONS:
        row = {"slab_fraction": frac, **await slab_decode(path, max(k, int(total * frac)), short, args.tokens, n_ctx)}
        slabs.append(row)
        print(
            f"slab {frac:.0%} ({row['slots']} slots): {row['tokens_per_second']:.2f} tok/s, hit rate "
            f"{row['hit_rate']:.2f}, {row['bytes_read_per_token'] / 2**20:.0f} MiB read per token",
            flush=True,
        )

    summary: dict[str, Any] = {
        name: spread([r[name] for r in rounds])
        for name in (
            "decode_ms_per_token",
            "cold_io_ms_per_token",
            "compute_io_ratio",
            "prefill_tokens_per_second",
            "decode_tokens_per_second",
            "prefill_over_decode",
        )
    }
    summary["split_ms"] = {
        part: statistics.median(r["split_ms"][part] for r in rounds) for part in rounds[0]["split_ms"]
    }
    summary["cold_io_bytes_per_token"] = statistics.median(r["cold_io_bytes_per_token"] for r in rounds)
    summary["targets"] = {
        name: {"op": op, "value": v, "verdict": verdict(name, summary[name]["median"])}
        for name, (op, v) in TARGETS.items()
    }
    summary["slabs"] = slabs
    print()
    for name, (op, target) in TARGETS.items():
        print(f"{name}: {fmt(summary[name])}  target {op} {target}: {summary['targets'][name]['verdict']}")
    print(
        "decode split per token (ms, median of rounds): "
        + ", ".join(f"{p} {v:.0f}" for p, v in summary["split_ms"].items())
    )

    facts["load_average_at_end"] = list(os.getloadavg())
    reads = {
        "backend": store_facts.backend,
        "direct_io": store_facts.direct_io,
        "fallback_reason": store_facts.fallback_reason,
        "liburing_unusable_reason": liburing_unusable_reason(),
        "backend_features": store_facts.backend_features,
        "cold": DROP_METHOD,
        "host_cache": host_cache.as_dict(),
    }
    parameters = {
        "command": command,
        "model": path.name,
        "architecture": architecture,
        "layers": len(layers),
        "experts_per_layer": per_layer,
        "expert_used": k,
        "tokens": args.tokens,
        "prompt": args.prompt,
        "rounds": args.rounds,
        "sampling": "greedy",
        "reads": reads,
    }
    units = {"_ms": "milliseconds", "tokens_per_second": "tokens/s", "bytes": "bytes"}
    out = write_results(args.out, "model_speed", parameters, units, rounds, summary, started, machine=facts)
    print(f"results: {out}")


def region(architecture: str) -> str:
    """The name of the docs' region for results of ``architecture`` (``model_speed`` for qwen3moe)."""
    return "model_speed" if architecture == "qwen3moe" else f"model_speed-{architecture}"


#: issue 33: the decode token's time outside the kernels and the reads (the MoE layers' routing,
#: pinning and hand-offs, and the forward pass's other time) at most this share of the token
OUTSIDE_KERNELS_MAX = 0.15


def outside_kernels(split: dict[str, float], decode_ms: float) -> float:
    """The share of a resident decode token outside the kernels and the reads: the MoE layers' time
    beside their expert kernels and expert waits, plus the pass's ``other`` time (the attention
    job, the head and sampling count as kernels: each is one compute job of products and numpy)."""
    rest = split["moe_ms"] - split["moe_expert_compute_ms"] - split["moe_io_wait_ms"] + split["other_ms"]
    return rest / decode_ms


def render(results: Path, doc: Path, region_name: str | None = None) -> None:
    """Replace the text between ``<!-- bench:REGION -->`` and its end marker in ``doc``: ``region_name``,
    or :func:`region` of the results' architecture (one region per CPU kind, named on the command line)."""
    r = json.loads(results.read_text())
    s, p, m = r["summary"], r["parameters"], r["machine"]
    reads = p["reads"]
    unusable = reads.get("liburing_unusable_reason")
    why = f" (on the raw-syscall ring: {unusable})" if unusable else ""
    t = s["targets"]
    for name in t:  # how many rounds met the target on their own
        t[name]["verdict"] += (
            f" ({sum(verdict(name, row[name]) == 'met' for row in r['rounds'])} of {p['rounds']} rounds met)"
        )
    load = f"{m['load_average_at_start'][0]:.1f} at the start, {m['load_average_at_end'][0]:.1f} at the end"
    split = s["split_ms"]
    kernels, waits = split["moe_expert_compute_ms"], split["moe_io_wait_ms"]
    outside = outside_kernels(split, s["decode_ms_per_token"]["median"])
    lines = [
        f"<!-- rendered by bench/model_speed.py --render {results} DOC"
        + (f" --region {region_name}" if region_name else "")
        + "; do not edit by hand -->",
        f"`{p['command']}` on {machine_label(m)}, {m['cpus_usable']} cores usable, started {r['started']}, "
        f"{r['seconds'] / 60:.0f} min; load average {load}. Model `{p['model']}` ({p['layers']} layers, "
        f"{p['experts_per_layer']} experts per layer, top-{p['expert_used']}), {p['sampling']}. Expert reads: "
        f"backend `{reads['backend']}`{why}; O_DIRECT {reads['direct_io']}; cold = {reads['cold']}. "
        + (f"Caveat: {reads['host_cache']['caveat']} " if reads["host_cache"]["caveat"] else "")
        + f"Figures are the median (min-max) of {p['rounds']} interleaved rounds (resident decode of "
        f"{p['tokens']} tokens, cold I/O of the same tokens' experts, resident prefill).",
        "",
        "| figure | measured | target |",
        "|---|---|---|",
        f"| decode compute per token, every expert resident | {fmt(s['decode_ms_per_token'], '.0f')} ms | |",
        "| of which attention / dense FFN / MoE / head / sampling / other (median) | "
        + " / ".join(f"{split[f'{x}_ms']:.1f}" for x in (*SPLIT, "other"))
        + " ms | |",
        "| of MoE: expert kernels / wait for experts / the rest (routing, pinning) | "
        + " / ".join(f"{v:.1f}" for v in (kernels, waits, split["moe_ms"] - kernels - waits))
        + " ms | |",
        f"| outside the kernels and reads (MoE's rest + other), share of the decode token | {outside:.1%} | "
        f"<= {OUTSIDE_KERNELS_MAX:.0%}: **{'met' if outside <= OUTSIDE_KERNELS_MAX else 'MISSED'}** |",
        f"| cold read of the same tokens' experts, layer after layer (0 % hits, "
        f"{s['cold_io_bytes_per_token'] / 2**20:.0f} MiB/token) | {fmt(s['cold_io_ms_per_token'], '.0f')} ms | |",
        f"| compute / I/O | {fmt(s['compute_io_ratio'])} | <= {t['compute_io_ratio']['value']}: "
        f"**{t['compute_io_ratio']['verdict']}** |",
        f"| prefill ({p['prompt']} tokens), every expert resident "
        f"| {fmt(s['prefill_tokens_per_second'], '.1f')} tok/s | |",
        f"| decode, every expert resident | {fmt(s['decode_tokens_per_second'])} tok/s | |",
        f"| prefill / decode rate | {fmt(s['prefill_over_decode'], '.1f')}x | >= {t['prefill_over_decode']['value']}x: "
        f"**{t['prefill_over_decode']['verdict']}** |",
    ]
    lines.extend(
        f"| decode, slab of {row['slab_fraction']:.0%} of the experts ({row['slots']} slots; cold start, one run) | "
        f"{row['tokens_per_second']:.2f} tok/s, hit rate {row['hit_rate']:.2f}, "
        f"{row['bytes_read_per_token'] / 2**20:.0f} MiB read/token | |"
        for row in s["slabs"]
    )
    name = region_name or region(p.get("architecture", "qwen3moe"))  # files before the field: the Qwen3 model
    replace_region(doc, name, lines)


def model_path(args: argparse.Namespace) -> Path:
    """The model ``--model`` and ``--layers`` name, a built-in one written first when missing."""
    if args.model == DSV4_NAME:
        return ensure_dsv4_model(args.layers or 4, progress=print_progress())
    if args.model:
        return Path(args.model).expanduser()
    return ensure_full_model(args.layers or 48, progress=print_progress())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--model",
        default=None,
        help=f"a whole-model GGUF file, or {DSV4_NAME!r} (the built-in DeepSeek-V4-Flash-geometry model); "
        "default: the built-in Qwen3-30B-A3B-geometry full model",
    )
    ap.add_argument("--layers", type=int, default=None, help="layers of the built-in model (default 48; dsv4-flash: 4)")
    ap.add_argument("--tokens", type=int, default=8, help="decoded tokens per round and per slab run")
    ap.add_argument("--prompt", type=int, default=256, help="prefill prompt length")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--render", nargs=2, type=Path, metavar=("RESULTS", "DOC"), help="render RESULTS into DOC, no run")
    ap.add_argument(
        "--region", default=None, help="with --render: DOC's region (default: the architecture's; one per CPU kind)"
    )
    args = ap.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if args.layers is not None and args.model not in (None, DSV4_NAME):
        ap.error("--layers chooses a built-in model; a --model file has its own")
    return args


if __name__ == "__main__":
    arguments = parse()
    if arguments.render:
        try:
            render(*arguments.render, region_name=arguments.region)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # missing, foreign or broken
            print(f"model_speed.py: error: {one_line_error(exc)}", file=sys.stderr)
            sys.exit(2)
    else:
        anyio.run(main, arguments)
