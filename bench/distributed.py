"""Expert shards: record a routing trace, simulate placements, measure Ray call costs, render the docs.

Steps (each writes into one results file, ``docs/results/distributed.json`` by default):

- ``trace``: run the built-in 8-layer full model (``~/.cache/aioexperts``, written by
  ``aioexperts-bench``/``make run``; nothing new is written) for a prompt and a greedy continuation
  with a recording runner (``aioexperts.load(..., runner=...)``); saves the routing trace (a small
  ``.npz``) beside the results;
- ``simulate``: replays that trace against round-robin, frequency-balanced and co-activation
  placements for 1, 2, 4 and 8 shards (no Ray): calls per token, load balance, per-shard hit rates,
  the latency added per layer at the measured call cost (or ``--call-ms``);
- ``calls``: on a local Ray cluster, the cost of an empty actor call, of one layer with 2 local
  shards against the local runner, and of 8 layers' calls batched into one against 8 calls;
- ``--render RESULTS DOC``: the region ``<!-- bench:distributed_shards -->`` of ``DOC`` from the results.

Run the measuring steps on an otherwise idle machine: ``python bench/distributed.py trace simulate calls``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _results import one_line_error  # bench/_results.py, a sibling module

import aioexperts
from aioexperts.distributed import (
    PLACEMENT_METHODS,
    ShardedRunner,
    expert_shard_actor,
    make_placement,
    round_robin_placement,
    simulate_shards,
)
from aioexperts.testing import full_model_path
from aioexperts_bench import dumps_json

#: the 8-layer built-in full model (what ``make run`` writes); the results file names the one that ran
MODEL = full_model_path(8)
RESULTS = Path("docs/results/distributed.json")
SHARDS = (1, 2, 4, 8)
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_json(data, indent=1) + "\n")


def _machine() -> dict[str, Any]:
    return {"cores": len(os.sched_getaffinity(0)), "load_average": list(os.getloadavg())}


async def record_trace(model: Path, trace_path: Path, n_tokens: int) -> dict[str, Any]:
    def recording(store: aioexperts.ExpertStore, prefetch: Any) -> aioexperts.MoERunner:
        return aioexperts.MoERunner(store, prefetch=prefetch, record_trace=True)

    start = _machine()
    t0 = time.perf_counter()
    async with aioexperts.load(model, slots=256, n_ctx=512, runner=recording) as m:
        out = [t async for t in m.generate(PROMPT, max_tokens=n_tokens, temperature=0.0)]
        trace = m.runner.routing_trace()
    trace.save(trace_path)
    return {
        "model": model.name,
        "prompt": PROMPT,
        "generated": len(out),
        "tokens": trace.n_tokens,
        "trace": trace_path.name,
        "seconds": time.perf_counter() - t0,
        "machine_start": start,
        "machine_end": _machine(),
    }


def simulate(model: Path, trace_path: Path, call_ms: float, submit_us: float, slots_fraction: float) -> dict[str, Any]:
    layout = aioexperts.build_layout(aioexperts.open_model(model))
    trace = aioexperts.RoutingTrace.load(trace_path)
    sizes = [
        np.array([layout.locate(layer, e).n_bytes for e in range(n)])
        for layer, n in zip(trace.layers, trace.n_experts, strict=True)
    ]
    n_embd = layout.layer(trace.layers[0]).banks[0].n_embd
    rows = []
    for n_shards in SHARDS:
        slots = max(trace.k, round(slots_fraction * trace.n_experts_total))  # the same slab on every node
        for method in PLACEMENT_METHODS:
            placement = make_placement(method, layout, n_shards, trace, n_embd=n_embd)
            sim = simulate_shards(trace, placement, sizes, slots_per_shard=slots, call_ms=call_ms, submit_us=submit_us)
            rows.append(
                {
                    "n_shards": n_shards,
                    "method": method,
                    "calls_per_token": sim.calls_per_token,
                    "calls_per_layer": sim.calls_per_layer,
                    "max_calls_per_token": sim.max_calls_per_token,
                    "load_imbalance": sim.load_imbalance,
                    "read_imbalance": sim.read_imbalance,
                    "hit_rates": list(sim.hit_rates),
                    "mean_hit_rate": float(np.mean(sim.hit_rates)),
                    "served_bytes": list(sim.served_bytes),
                    "read_bytes": list(sim.read_bytes),
                    "slots_per_shard": sim.slots_per_shard,
                    "added_ms_per_layer": sim.added_ms_per_layer,
                    "added_ms_per_token": sim.added_ms_per_token,
                }
            )
    return {
        "trace": trace_path.name,
        "tokens": trace.n_tokens,
        "layers": trace.n_layers,
        "k": trace.k,
        "experts": trace.n_experts_total,
        "expert_bytes": int(sizes[0][0]),
        "slots_fraction": slots_fraction,
        "call_ms": call_ms,
        "submit_us": submit_us,
        "rows": rows,
    }


def _ms(values: list[float]) -> dict[str, float]:
    return {"median": 1e3 * statistics.median(values), "min": 1e3 * min(values), "max": 1e3 * max(values)}


async def measure_calls(model: Path, rounds: int) -> dict[str, Any]:
    import ray

    start = _machine()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        io = aioexperts.IOOptions(backend="threads")
        async with aioexperts.open(model, slots=64, io=io) as store:
            layers = list(store.layout.layers)
            placement = round_robin_placement(store.layout, 2, n_embd=store.hparams.n_embd)
            actor = expert_shard_actor()
            shards = [actor.remote(str(model), placement, i, slots=64, io=io) for i in range(2)]
            runner = ShardedRunner(store, shards, placement)
            local = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(depth=0))
            await runner.warmup()
            rng = np.random.default_rng(0)
            x = rng.standard_normal((1, store.hparams.n_embd)).astype(np.float32) * 0.1
            layer = layers[0]
            # empty call: the round trip of Ray alone
            for _ in range(20):
                await shards[0].describe.remote()
            empty = []
            for _ in range(rounds * 10):
                t0 = time.perf_counter()
                await shards[0].describe.remote()
                empty.append(time.perf_counter() - t0)
            # one layer, warm (same x: every expert a hit), local vs 2 shards
            for _ in range(3):
                await local.moe(layer, x)
                await runner.moe(layer, x)
            local_t, shard_t = [], []
            for _ in range(rounds * 5):
                t0 = time.perf_counter()
                await local.moe(layer, x)
                local_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await runner.moe(layer, x)
                shard_t.append(time.perf_counter() - t0)
            # batching: one shard, its experts of every layer for this x, 8 calls vs one call
            routed = {lay: await local.moe_result(lay, x, prefetch=False) for lay in layers}
            owner = [placement.owner_of(lay) for lay in layers]
            calls = []
            for i, lay in enumerate(layers):
                ids = routed[lay].ids
                mine = np.where(owner[i][ids] == 0, ids, -1).astype(np.int32)
                calls.append((lay, x, mine, routed[lay].weights, [], []))
            for _ in range(3):
                await shards[0].partial_layers.remote(calls)
            single, batched = [], []
            for _ in range(rounds * 2):
                t0 = time.perf_counter()
                for call in calls:
                    await shards[0].partial.remote(*call)
                single.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await shards[0].partial_layers.remote(calls)
                batched.append(time.perf_counter() - t0)
            for h in shards:
                ray.kill(h)
        plain, compiled, compiled_note = _echo_costs(ray, x, rounds * 20)
    finally:
        ray.shutdown()
    return {
        "model": model.name,
        "ray": ray.__version__,
        "rounds": rounds,
        "layers": len(layers),
        "empty_call_ms": _ms(empty),
        "layer_local_ms": _ms(local_t),
        "layer_two_shards_ms": _ms(shard_t),
        "eight_layers_eight_calls_ms": _ms(single),
        "eight_layers_one_call_ms": _ms(batched),
        "echo_plain_ms": _ms(plain),
        "echo_compiled_ms": _ms(compiled) if compiled else None,
        "compiled_note": compiled_note,
        "machine_start": start,
        "machine_end": _machine(),
    }


def _echo_costs(ray: Any, x: np.ndarray, n: int) -> tuple[list[float], list[float], str]:
    """A sync actor echoing ``x``: plain calls, then the same through a Ray compiled graph."""

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, value: Any) -> Any:
            return value

    actor = Echo.remote()
    plain, compiled = [], []
    for _ in range(20):
        ray.get(actor.echo.remote(x))
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(actor.echo.remote(x))
        plain.append(time.perf_counter() - t0)
    note = "ray.dag compiled graph, one sync actor, the same array"
    try:
        from ray.dag import InputNode

        with InputNode() as inp:
            dag = actor.echo.bind(inp)
        graph = dag.experimental_compile()
        try:
            for _ in range(20):
                ray.get(graph.execute(x))
            for _ in range(n):
                t0 = time.perf_counter()
                ray.get(graph.execute(x))
                compiled.append(time.perf_counter() - t0)
        finally:
            graph.teardown()
    except Exception as exc:  # noqa: BLE001 - an unavailable feature is a result too
        note = f"compiled graph unavailable: {type(exc).__name__}: {exc}"
    ray.kill(actor)
    return plain, compiled, note


# -- rendering ----------------------------------------------------------------------------------

START, END = "<!-- bench:distributed_shards -->", "<!-- /bench:distributed_shards -->"


def _f(value: float, spec: str = ".2f") -> str:
    return format(value, spec)


def render_region(results: dict[str, Any], source: str) -> str:
    sim, trace, calls = results["simulate"], results.get("trace", {}), results.get("calls")
    lines = [
        START,
        f"<!-- rendered by bench/distributed.py --render {source} DOC; do not edit by hand -->",
        "",
        f"Trace: `{sim['trace']}`, {sim['tokens']} tokens of `{trace.get('model', '?')}` ({sim['layers']} MoE layers, "
        f"top-{sim['k']}, {sim['experts']} experts of {sim['expert_bytes'] / 2**20:.2f} MiB); the built-in model has "
        "random weights, so its routing is less skewed than a trained model's. Each shard's slab holds "
        f"{sim['slots_fraction']:.0%} of the model's experts (LRU); the latency model takes {sim['call_ms']:.3g} ms "
        f"per round trip and {sim['submit_us']:.3g} us per further call of a layer.",
        "",
        "| shards | placement | calls / token | calls / layer | max / mean bytes | mean hit rate "
        "| hit rate per shard | added ms / layer | added ms / token |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in sim["rows"]:
        rates = " ".join(f"{100 * h:.0f}%" for h in r["hit_rates"])
        lines.append(
            f"| {r['n_shards']} | {r['method']} | {_f(r['calls_per_token'], '.1f')} | {_f(r['calls_per_layer'])} | "
            f"{_f(r['load_imbalance'], '.3f')} | {100 * r['mean_hit_rate']:.1f}% | {rates} | "
            f"{_f(r['added_ms_per_layer'])} | {_f(r['added_ms_per_token'], '.1f')} |"
        )
    if calls:
        m0, m1 = calls["machine_start"]["load_average"][0], calls["machine_end"]["load_average"][0]
        lines += [
            "",
            f"Measured on this machine (Ray {calls['ray']}, 2 local shards on `{calls['model']}`, one token, warm "
            f"slabs; median (min-max) of {calls['rounds']}x the repeats; load average {m0:.1f} at the start, "
            f"{m1:.1f} at the end, so the machine was shared):",
            "",
            "| what | ms |",
            "|---|---:|",
        ]
        for key, label in (
            ("empty_call_ms", "one empty actor call (round trip)"),
            ("layer_local_ms", "one MoE layer, local runner"),
            ("layer_two_shards_ms", "one MoE layer, 2 local shards"),
            ("eight_layers_eight_calls_ms", f"{calls['layers']} layers' work for one shard, {calls['layers']} calls"),
            ("eight_layers_one_call_ms", "the same in one call (`partial_layers`)"),
            ("echo_plain_ms", "an echo of one row, plain actor call (sync actor)"),
            ("echo_compiled_ms", "the same through a compiled graph (`ray.dag`)"),
        ):
            s = calls.get(key)
            if s is None:
                lines.append(f"| {label} | not measured: {calls.get('compiled_note', '')} |")
                continue
            lines.append(f"| {label} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) |")
    lines.append(END)
    return "\n".join(lines)


def render(results_path: Path, doc: Path) -> None:
    text = doc.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{doc}: no {START} ... {END} region")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    data = json.loads(results_path.read_text())  # a missing file is an error here, not {}
    doc.write_text(before + render_region(data, str(results_path)) + after)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", nargs="*", metavar="STEP", help="trace, simulate, calls: what to run, in order")
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tokens", type=int, default=48, help="tokens generated for the trace")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--call-ms", type=float, default=None, help="round trip (default: the measured empty call)")
    parser.add_argument("--submit-us", type=float, default=100.0, help="cost of each further call of a layer")
    parser.add_argument("--slots-fraction", type=float, default=0.25, help="each shard's slab, of all experts")
    parser.add_argument("--render", nargs=2, type=Path, metavar=("RESULTS", "DOC"))
    args = parser.parse_args(argv)
    if args.render:
        try:
            render(*args.render)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # missing, foreign or broken
            print(f"{parser.prog}: error: {one_line_error(exc)}", file=sys.stderr)
            return 2
        return 0
    unknown = [s for s in args.steps if s not in ("trace", "simulate", "calls")]
    if unknown or not args.steps:
        parser.error(f"steps are trace, simulate, calls; got {args.steps}")
    data = _load(args.out)
    trace_path = args.out.with_name("distributed-trace.npz")
    for step in args.steps:
        if step == "trace":
            data["trace"] = asyncio.run(record_trace(args.model, trace_path, args.tokens))
        elif step == "calls":
            data["calls"] = asyncio.run(measure_calls(args.model, args.rounds))
        else:
            call_ms = args.call_ms
            if call_ms is None:
                call_ms = data["calls"]["empty_call_ms"]["median"] if "calls" in data else 1.0
            data["simulate"] = simulate(args.model, trace_path, call_ms, args.submit_us, args.slots_fraction)
        _save(args.out, data)
        print(f"{step}: done, {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
