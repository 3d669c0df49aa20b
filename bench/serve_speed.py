"""Serving speed: concurrent decode streams, cross-request expert batching on and off, hits-first.

Usage::

    python bench/serve_speed.py --rounds 2 --out docs/results/serve_speed-48l.json
    python bench/serve_speed.py --render docs/results/serve_speed-48l.json docs/serving.md

The model is the built-in full model at ``--layers`` (Qwen3-30B-A3B geometry, Q4_K experts; routers
spread over the experts, or ``--routing skewed``: 8 hot experts per layer take about half of the
picks, as in trained models; written once into the user cache), loaded once with a slab of
``--slab`` of the experts. The streams are sequences of the
:class:`aioexperts.Model` API, each in its own task (what a server does with ``--parallel N``): each
prefills its own short prompt (not timed), then all decode greedily from the same moment. Every round
runs, for 1, 4 and 16 streams, batching on and off (the order alternates from round to round; the
runner's ``batch_wait`` is switched between the runs, the slab stays warm). Then, per round, one
stream runs with hits-first off and on, each in a fresh load with a slab of ``--hf-slab`` and no
prefetch, filled by the same warm-up prompt first: about half the experts a token picks are still
resident (the hit rate is reported). Per run: aggregate tokens/s (decoded tokens / wall time from
the common start to the last token), the per-token latency (the time between a stream's consecutive tokens) p50 and
p99, experts per read request (distinct experts per layer step), rows per step, the slab hit rate
(experts READY when pinned), bytes read per token, and the model's attention and MoE time per
token. The streams' tokens with batching on must equal those with it off (checked).

Targets (issue 22): at 4 streams aggregate tok/s with batching >= 1.4x without; hits-first >= 5 %
faster per token at ~50 % hits; p99 token latency at 4 streams <= 2x that of 1 stream (batching on).
Each ratio is taken per round; the summary gives the median (min-max).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402

import aioexperts  # noqa: E402
from aioexperts._model.forward import DECODE_BATCH_MAX_CALLS  # noqa: E402
from aioexperts._runner import BATCH_MAX_CALLS  # noqa: E402
from aioexperts.backends import liburing_unusable_reason  # noqa: E402
from aioexperts.testing import FULL_SPEC, SKEWED_SPEC, ensure_full_model, print_progress  # noqa: E402
from aioexperts_bench import machine_facts, machine_label  # noqa: E402

IO = aioexperts.IOOptions(backend="auto")  # io_uring when it runs here, else the thread pool
STREAMS = (1, 4, 16)
TARGETS = {
    "batching_speedup_4": (">=", 1.4),
    "hits_first_speedup": (">=", 1.05),
    "p99_4_over_1": ("<=", 2.0),
}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


async def decode_streams(model: aioexperts.Model, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Each prompt in its own sequence and task: prefill, wait for all, then ``tokens`` greedy steps each."""
    n = len(prompts)
    prefilled = 0
    start = anyio.Event()
    begun = 0.0
    gaps: list[float] = []
    last_token_at: list[float] = []
    out: dict[int, list[int]] = {}

    async def stream(i: int) -> None:
        nonlocal prefilled, begun
        async with model.sequence() as seq:
            logits = (await seq.forward(prompts[i], all_logits=False))[0]
            prefilled += 1
            if prefilled == n:  # the counters from here: decode only
                snapshot.extend((model.store.statistics(), model.runner.statistics(), model.statistics()))
                begun = time.perf_counter()
                start.set()
            await start.wait()
            got: list[int] = []
            t = begun
            for _ in range(tokens):
                got.append(int(np.argmax(logits)))
                logits = (await seq.forward(got[-1:], all_logits=False))[0]
                now = time.perf_counter()
                gaps.append((now - t) * 1e3)
                t = now
            last_token_at.append(t)
            out[i] = got

    snapshot: list[Any] = []
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(stream, i)
    st0, ru0, mo0 = snapshot
    st1, ru1, mo1 = model.store.statistics(), model.runner.statistics(), model.statistics()
    wall = max(last_token_at) - begun
    steps = ru1.layer_steps - ru0.layer_steps

    def total(st: aioexperts.RunnerStatistics, mean: float | None) -> float:
        return (mean or 0.0) * st.layer_steps

    requests = st1.requests - st0.requests
    decoded = max(1, mo1.tokens_decoded - mo0.tokens_decoded)
    batched = mo1.batched_steps - mo0.batched_steps
    return {
        "streams": n,
        "tokens_per_stream": tokens,
        "seconds": wall,
        "tokens_per_second": n * tokens / wall,
        "token_ms_p50": percentile(gaps, 50),
        "token_ms_p99": percentile(gaps, 99),
        "token_ms": gaps,
        "layer_steps": steps,
        "experts_per_read": (total(ru1, ru1.experts_per_step) - total(ru0, ru0.experts_per_step)) / max(1, steps),
        "rows_per_step": (total(ru1, ru1.rows_per_step) - total(ru0, ru0.rows_per_step)) / max(1, steps),
        "batches": ru1.batches - ru0.batches,
        "batched_calls": ru1.batched_calls - ru0.batched_calls,
        "decode_steps_batched": batched,
        "sequences_per_batched_step": (mo1.batched_tokens - mo0.batched_tokens) / max(1, batched),
        "window_ms_per_token": (mo1.batch_window_seconds - mo0.batch_window_seconds) * 1e3 / decoded,
        "attention_ms_per_token": (mo1.attention_seconds - mo0.attention_seconds) * 1e3 / decoded,
        "moe_ms_per_token": (mo1.moe_seconds - mo0.moe_seconds) * 1e3 / decoded,
        "hits_first_steps": ru1.hits_first_steps - ru0.hits_first_steps,
        "hit_rate": (st1.hits - st0.hits) / max(1, requests),
        "inflight_join_rate": (st1.inflight_joins - st0.inflight_joins) / max(1, requests),
        "bytes_read_per_token": (st1.bytes_read - st0.bytes_read) / (n * tokens),
        # the share of the wall time with a read in flight: near 1, the disk bounds the run, not compute
        "disk_busy_fraction": (st1.device_busy_seconds - st0.device_busy_seconds) / wall,
        "generated": [out[i] for i in range(n)],
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def verdict(name: str, value: float) -> str:
    op, target = TARGETS[name]
    return "met" if (value <= target if op == "<=" else value >= target) else "MISSED"


def fmt(s: dict[str, float], spec: str = ".2f") -> str:
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def brief(run: dict[str, Any]) -> str:
    return (
        f"{run['tokens_per_second']:.2f} tok/s, p50 {run['token_ms_p50']:.0f} / p99 {run['token_ms_p99']:.0f} ms, "
        f"{run['experts_per_read']:.1f} experts/read, {run['rows_per_step']:.1f} rows/step, "
        f"hits {run['hit_rate']:.2f}, {run['sequences_per_batched_step']:.1f} sequences per batched step, "
        f"attention {run['attention_ms_per_token']:.0f} / MoE {run['moe_ms_per_token']:.0f} ms per token"
    )


async def main(args: argparse.Namespace) -> None:
    started = time.time()
    command = "python bench/serve_speed.py " + " ".join(sys.argv[1:])
    spec = (SKEWED_SPEC if args.routing == "skewed" else FULL_SPEC).with_(n_layer=args.layers)
    path = ensure_full_model(spec=spec, progress=print_progress())
    logging.getLogger("aioexperts").setLevel(logging.ERROR)
    facts = machine_facts(str(path))
    async with aioexperts.open(path, slots=1, io=IO) as probe:
        layers = probe.layout.layers
        k, per_layer = probe.layout.n_expert_used, max(m.n_experts for m in layers.values())
    total = sum(m.n_experts for m in layers.values())
    slots = max(2 * k * max(STREAMS), int(total * args.slab))
    n_ctx = args.prompt + args.tokens + 8
    print(
        f"model: {path.name}: {len(layers)} MoE layers, {per_layer} experts, top-{k}; {slots} slots; "
        f"{machine_label(facts)}",
        flush=True,
    )
    rounds: list[dict[str, Any]] = []
    async with aioexperts.load(path, slots=slots, io=IO, n_ctx=n_ctx, batch_wait=args.batch_wait) as model:
        store_facts = model.store.statistics()
        vocab = model.n_vocab
        print(f"reads: backend {store_facts.backend}, O_DIRECT {store_facts.direct_io}", flush=True)
        runner = model.runner
        t0 = time.perf_counter()
        warm_rng = np.random.default_rng(1000)
        await decode_streams(model, [warm_rng.integers(0, model.n_vocab, args.prompt).tolist() for _ in range(4)], 2)
        print(f"warm-up: {time.perf_counter() - t0:.0f} s", flush=True)
        for r in range(args.rounds):
            rng = np.random.default_rng(r)
            row: dict[str, Any] = {"round": r, "load_average": os.getloadavg(), "runs": {}}
            for n in STREAMS:
                prompts = [rng.integers(0, model.n_vocab, args.prompt).tolist() for _ in range(n)]
                tokens = args.tokens if n < 16 else args.tokens16
                order = (True, False) if r % 2 == 0 else (False, True)
                for on in order:
                    runner.batch_wait = args.batch_wait if on else 0
                    run = await decode_streams(model, prompts, tokens)
                    row["runs"][f"{n}-{'on' if on else 'off'}"] = run
                    print(f"round {r}: {n} streams, batching {'on ' if on else 'off'}: {brief(run)}", flush=True)
                same = row["runs"][f"{n}-on"]["generated"] == row["runs"][f"{n}-off"]["generated"]
                assert same, f"{n} streams: the tokens with batching differ from those without"
            runner.batch_wait = args.batch_wait
            rounds.append(row)

    # hits-first at about half hits: each run loads the model afresh with a slab of --hf-slab and no
    # prefetch, fills the slab with a warm-up prompt (the same for both runs: the same slab state),
    # then decodes the measured prompt; the hits are the experts still resident from earlier tokens
    hf_slots = max(2 * k, int(total * args.hf_slab))
    no_prefetch = aioexperts.PrefetchOptions(depth=0)
    fill_tokens = -(-hf_slots // (k * len(layers))) + 2
    hf_ctx = args.prompt + max(fill_tokens, args.tokens_hf) + 8

    async def hits_first_run(on: bool, warm: list[int], prompt: list[int]) -> dict[str, Any]:
        async with aioexperts.load(path, slots=hf_slots, io=IO, n_ctx=hf_ctx, prefetch=no_prefetch) as model:
            model.runner.hits_first = on
            await decode_streams(model, [warm], fill_tokens)
            return await decode_streams(model, [prompt], args.tokens_hf)

    for r, row in enumerate(rounds):
        rng = np.random.default_rng(100 + r)
        warm, prompt = (rng.integers(0, vocab, args.prompt).tolist() for _ in range(2))
        for on in (False, True) if r % 2 == 0 else (True, False):
            run = await hits_first_run(on, warm, prompt)
            row["runs"][f"hf-{'on' if on else 'off'}"] = run
            print(f"round {r}: 1 stream, hits-first {'on ' if on else 'off'}: {brief(run)}", flush=True)
        same = row["runs"]["hf-on"]["generated"] == row["runs"]["hf-off"]["generated"]
        assert same, "the tokens with hits-first differ from those without"
        runs = row["runs"]
        row["batching_speedup"] = {
            str(n): runs[f"{n}-on"]["tokens_per_second"] / runs[f"{n}-off"]["tokens_per_second"] for n in STREAMS
        }
        row["batching_speedup_4"] = row["batching_speedup"]["4"]
        row["hits_first_speedup"] = runs["hf-off"]["seconds"] / runs["hf-on"]["seconds"]
        row["p99_4_over_1"] = runs["4-on"]["token_ms_p99"] / runs["1-on"]["token_ms_p99"]
        for run in runs.values():
            run.pop("generated", None)
        print(
            f"round {r}: batching speed-up at 4 streams {row['batching_speedup_4']:.2f}x, hits-first "
            f"{row['hits_first_speedup']:.2f}x, p99 4/1 streams {row['p99_4_over_1']:.2f}; "
            f"load {row['load_average'][0]:.1f}",
            flush=True,
        )

    keys = [*(f"{n}-{b}" for n in STREAMS for b in ("on", "off")), "hf-off", "hf-on"]
    fields = (
        "tokens_per_second",
        "token_ms_p50",
        "token_ms_p99",
        "experts_per_read",
        "rows_per_step",
        "hit_rate",
        "bytes_read_per_token",
        "disk_busy_fraction",
        "attention_ms_per_token",
        "moe_ms_per_token",
    )
    summary: dict[str, Any] = {
        "runs": {
            key: {f: spread([row["runs"][key][f] for row in rounds]) for f in fields if f in rounds[0]["runs"][key]}
            for key in keys
        },
        "batching_speedup": {str(n): spread([row["batching_speedup"][str(n)] for row in rounds]) for n in STREAMS},
    }
    for name in TARGETS:
        summary[name] = spread([row[name] for row in rounds])
    summary["targets"] = {
        name: {
            "op": op,
            "value": v,
            "verdict": verdict(name, summary[name]["median"]),
            "rounds_met": sum(verdict(name, row[name]) == "met" for row in rounds),
        }
        for name, (op, v) in TARGETS.items()
    }
    print()
    for name, (op, target) in TARGETS.items():
        print(f"{name}: {fmt(summary[name])}  target {op} {target}: {summary['targets'][name]['verdict']}")
    facts["load_average_at_end"] = list(os.getloadavg())
    parameters = {
        "command": command,
        "model": path.name,
        "layers": len(layers),
        "experts_per_layer": per_layer,
        "expert_used": k,
        "slots": slots,
        "slab_fraction": args.slab,
        "routing": args.routing,
        "hits_first_slab_fraction": args.hf_slab,
        "hits_first_slots": hf_slots,
        "hits_first_fill_tokens": fill_tokens,
        "batch_max_calls": BATCH_MAX_CALLS,
        "decode_batch_max_sequences": DECODE_BATCH_MAX_CALLS,
        "prompt": args.prompt,
        "tokens": args.tokens,
        "tokens16": args.tokens16,
        "tokens_hits_first": args.tokens_hf,
        "batch_wait": args.batch_wait,
        "rounds": args.rounds,
        "sampling": "greedy",
        "reads": {
            "backend": store_facts.backend,
            "direct_io": store_facts.direct_io,
            "liburing_unusable_reason": liburing_unusable_reason(),
        },
    }
    units = {"_ms": "milliseconds", "tokens_per_second": "tokens/s", "bytes": "bytes", "seconds": "seconds"}
    out = write_results(args.out, "serve_speed", parameters, units, rounds, summary, started, machine=facts)
    print(f"results: {out}")


REGION = ("<!-- bench:serve_speed -->", "<!-- /bench:serve_speed -->")
#: the doc region of each routing's results (spread: the built-in model the targets are set for)
REGIONS = {"spread": REGION, "skewed": ("<!-- bench:serve_speed-skewed -->", "<!-- /bench:serve_speed-skewed -->")}


def region_of(results: Path) -> tuple[str, str]:
    """The doc region a results file renders into (by its ``routing``; files before it: spread)."""
    return REGIONS[json.loads(results.read_text())["parameters"].get("routing", "spread")]


def _commit(commit: str | None) -> str:
    """``aioexperts 0123456789`` (``+dirty`` kept), or "" when the results file has none."""
    return f"aioexperts {commit[:10]}{'+dirty' if commit.endswith('+dirty') else ''}" if commit else ""


def render_lines(results: Path) -> list[str]:
    r = json.loads(results.read_text())
    s, p, m = r["summary"], r["parameters"], r["machine"]
    t = s["targets"]
    reads = p["reads"]
    why = f" because {reads['liburing_unusable_reason']}" if reads.get("liburing_unusable_reason") else ""
    load = f"{m['load_average_at_start'][0]:.1f} at the start, {m['load_average_at_end'][0]:.1f} at the end"
    runs = s["runs"]
    if "decode_batch_max_sequences" in p:
        caps = (
            f"; one decode step at a time for up to {p['decode_batch_max_sequences']} sequences, its MoE "
            f"layers in calls of up to {p['batch_max_calls']} sequences"
        )
    else:
        caps = f", at most {p['batch_max_calls']} calls per batch" if "batch_max_calls" in p else ""
    hf = (
        f" The hits-first runs load the model afresh with a slab of {p['hits_first_slab_fraction']:.0%} "
        f"({p['hits_first_slots']} slots) and no prefetch, filled by {p['hits_first_fill_tokens']} tokens of "
        "one warm-up prompt first (the same for both runs)."
        if "hits_first_slots" in p
        else ""
    )

    def read_rate(key: str) -> str:
        """The disk's delivered rate (GB/s, tokens/s x bytes/token), median of the rounds."""
        done = [row["runs"][key] for row in rounds]
        rates = [run["tokens_per_second"] * run["bytes_read_per_token"] / 1e9 for run in done]
        return f"{statistics.median(rates):.2f}" if rates else "-"

    rounds = r.get("rounds", [])

    def row(label: str, key: str) -> str:
        x = runs[key]
        busy = f"{x['disk_busy_fraction']['median']:.0%}" if "disk_busy_fraction" in x else "-"
        return (
            f"| {label} | {fmt(x['tokens_per_second'])} | {fmt(x['token_ms_p50'], '.0f')} | "
            f"{fmt(x['token_ms_p99'], '.0f')} | {x['experts_per_read']['median']:.1f} | "
            f"{x['rows_per_step']['median']:.1f} | {x['hit_rate']['median']:.2f} | "
            f"{x['bytes_read_per_token']['median'] / 2**20:.0f} | {read_rate(key)} | {busy} |"
        )

    def target(name: str, label: str, unit: str = "x") -> str:
        v = t[name]
        return (
            f"| {label} | {fmt(s[name])}{unit} | {v['op']} {v['value']}{unit}: **{v['verdict']}** "
            f"({v['rounds_met']} of {p['rounds']} rounds met) |"
        )

    lines = [
        f"<!-- rendered by bench/serve_speed.py --render {results} DOC; do not edit by hand -->",
        f"`{p['command']}` on {machine_label(m)}, {m['cpus_usable']} cores usable (shared with other work: "
        f"load average {load}), started {r['started']}, {r['seconds'] / 60:.0f} min, "
        f"{_commit(m.get('aioexperts_commit')) or 'aioexperts commit unknown'}. Model `{p['model']}` "
        f"({p['layers']} layers, {p['experts_per_layer']} experts per layer, top-{p['expert_used']}, "
        f"{p.get('routing', 'spread')} routing), a slab of "
        f"{p['slab_fraction']:.0%} of the experts ({p['slots']} slots), expert reads through `{reads['backend']}`"
        f"{why}. Streams are sequences of the Model API in their own tasks, each with a {p['prompt']}-token "
        f"prompt, then {p['tokens']} greedy tokens ({p['tokens16']} at 16 streams) from a common start; "
        f"batching window {p['batch_wait']} s{caps}. Median (min-max) of {p['rounds']} interleaved rounds; ratios "
        "are taken per round. Latency is the time between a stream's consecutive tokens; hit rate is the "
        f"share of pinned experts already in the slab; read GB/s is what the disk delivered (tok/s x bytes "
        f"per token); disk busy is the share of the wall time with at least one read in flight (near 100 %: "
        f"the disk bounds the run, and neither batching nor compute can shorten it).{hf}",
        "",
        "| run | aggregate tok/s | p50 ms/token | p99 ms/token | experts per read | rows per step | hit rate "
        "| MiB read/token | read GB/s | disk busy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines.extend(
        row(f"{n} stream{'s' if n > 1 else ''}, batching {b}", f"{n}-{b}") for n in STREAMS for b in ("on", "off")
    )
    lines.append(row("1 stream, hits-first off", "hf-off"))
    lines.append(row("1 stream, hits-first on", "hf-on"))
    lines += [
        "",
        "Where a decode token's time goes (ms per token, median; attention: the jobs of the norms, attention and "
        "routing; MoE: the MoE layers' wall time, expert waits included): "
        + "; ".join(
            f"{n} stream{'s' if n > 1 else ''} batching {b} "
            f"{runs[f'{n}-{b}']['attention_ms_per_token']['median']:.0f} / "
            f"{runs[f'{n}-{b}']['moe_ms_per_token']['median']:.0f}"
            for n in STREAMS
            for b in ("on", "off")
            if "attention_ms_per_token" in runs[f"{n}-{b}"]
        )
        + ".",
        "",
        "| figure | measured | target |",
        "|---|---|---|",
        target("batching_speedup_4", "4 streams: aggregate tok/s, batching on / off"),
        f"| 16 streams: aggregate tok/s, batching on / off | {fmt(s['batching_speedup']['16'])}x | |",
        target("hits_first_speedup", "1 stream: time per token, hits-first off / on"),
        target("p99_4_over_1", "p99 token latency, 4 streams / 1 stream (batching on)"),
    ]
    return lines


def render(results: Path, doc: Path) -> None:
    """Replace the text between the region markers of ``results``' routing (:data:`REGIONS`) in ``doc``."""
    text = doc.read_text()
    start, end = region_of(results)
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + start + "\n" + "\n".join(render_lines(results)) + "\n" + end + tail)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48, help="layers of the built-in full model")
    ap.add_argument("--slab", type=float, default=0.25, help="slab size as a share of all experts")
    ap.add_argument("--routing", choices=("spread", "skewed"), default="spread", help="the built-in model's routers")
    ap.add_argument("--hf-slab", type=float, default=0.5, help="slab of the hits-first runs (no prefetch)")
    ap.add_argument("--prompt", type=int, default=4, help="prompt tokens per stream (prefill, not timed)")
    ap.add_argument("--tokens", type=int, default=4, help="decoded tokens per stream (1 and 4 streams)")
    ap.add_argument("--tokens16", type=int, default=2, help="decoded tokens per stream at 16 streams")
    ap.add_argument("--tokens-hf", type=int, default=6, help="decoded tokens of the hits-first runs")
    ap.add_argument("--batch-wait", type=float, default=0.05, help="the batching window (seconds)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--render", nargs=2, type=Path, metavar=("RESULTS", "DOC"), help="render RESULTS into DOC, no run")
    return ap.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    if arguments.render:
        render(*arguments.render)
    else:
        anyio.run(main, arguments)
