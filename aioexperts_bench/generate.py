"""``aioexperts-bench --mode generate``: aioexperts against llama.cpp on one model under memory limits.

Per memory limit (none, or a fraction of the model file's size) and per round, every engine runs
once, in this order (aioexperts, llama.cpp with its defaults, llama.cpp with repack off), each in
a process of its own (:mod:`aioexperts_bench.generate_worker`) inside a cgroup v1/v2 memory cgroup
the bench makes and removes itself (:mod:`aioexperts_bench.cgroup`), after the model file's page
cache was dropped. Each run prefills the same prompt of varied token ids and then evaluates the same
fixed sequence of varied ids one at a time (teacher-forced), taking the greedy token at each step.

Per run: decode tokens/s (mean over the steps) and per-token latency p5/p50/p95, prefill tokens/s,
time to first token (the prompt's prefill), major faults and bytes read from the device per decode
token (``/proc/self/io`` of the engine's process), peak RSS, the cgroup's peak usage and failed
charges, page-cache bytes of the model file after the run (``mincore``), and for aioexperts the
expert hit rate, distinct experts touched per layer and the slab size it chose. A run the OOM
killer ended is reported as ``oom-killed`` (with what it did before), one over ``--run-timeout`` as
``timeout``. Per round: aioexperts' decode tokens/s over the better llama.cpp run that decoded
(ratios), and how many greedy tokens agree.

With no memory limit every engine is warmed first (``warm_prefill``: one prefill of the prompt
thrown away, reported apart as the cold start), so the measured prefill and decode are steady
states. Under a limit, each round ends with fio reading random experts of the model (planned as the
store plans them, ``O_DIRECT``, depth 64): the device's rate in the same run, against which a
round's ``pipeline_ratio`` is taken (decode seconds per token over the larger of expert bytes per
token / fio's rate and the decode seconds per token with every expert resident, the no-limit runs).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .cachestate import DROP_METHOD, drop_page_cache
from .cgroup import MemoryCgroup, unavailable_reason
from .generate_worker import DEFAULT_ENGINES, LLAMA_ENGINES
from .machine import machine_facts

__all__ = (
    "SCHEMA",
    "TARGETS",
    "GenerateConfig",
    "llama_unavailable_reason",
    "page_cache_bytes",
    "parse_limit",
    "run_engine",
    "run_generate_bench",
    "summarize",
    "token_ids",
)

SCHEMA = "aioexperts-bench-generate/1"
#: (limit, what, op, threshold); ``what`` is a per-round ratio aioexperts / llama.cpp's best setting
#: that decoded: under a limit issue 20's and issue 36's (decode >= 10x at 1/4), with no limit
#: issue 33's (decode >= 0.9x, prefill >= 0.8x; "outside": the share of a decode token spent outside
#: the compiled fan-outs <= 15 %, aioexperts alone).
TARGETS = (
    ("1/4", "decode", ">=", 10.0),
    ("1/4", "p95", "<=", 0.1),
    ("1/2", "decode", ">=", 2.0),
    ("none", "decode", ">=", 0.9),
    ("none", "prefill", ">=", 0.8),
    ("none", "outside", "<=", 0.15),
    ("1/4", "pipeline", "<=", 1.25),
    ("1/2", "pipeline", "<=", 1.25),
)
#: under 1/2, where llama.cpp's working set fits (few major faults per decode token)
FITS_TARGET = ("1/2", "decode", ">=", 0.7)
FITS_FAULTS_PER_TOKEN = 10.0


def llama_unavailable_reason() -> str | None:
    """None when llama-cpp-python is importable, else the one line the bench prints."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (
            "llama-cpp-python is not installed: aioexperts runs alone (pip install 'aioexperts[baseline]' "
            "builds llama.cpp from source, about 7 minutes on 2 cores)"
        )
    return None


def parse_limit(text: str) -> Fraction | None:
    """``"none"`` -> None, ``"1/4"`` -> Fraction(1, 4) (of the model's size); ValueError otherwise."""
    text = text.strip()
    if text == "none":
        return None
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(
            f"a memory limit is 'none' or a fraction like 1/4 or 0.5 of the model's size, got {text!r}"
        ) from None
    if not 0 < value <= 4:
        raise ValueError(f"a memory limit is a fraction of the model's size in (0, 4], got {text!r}")
    return value


def check_sidecar(sidecar: str, model: str) -> None:
    """The miss-tier ``sidecar`` is one of ``model`` (read as the store reads it), before a run.

    Raises:
        StaleMapError, FormatError: a stale, mismatched or malformed sidecar (as the store's start).
        OSError: it cannot be read.
    """
    from aioexperts import build_layout, open_model
    from aioexperts._format.tier_sidecar import read_tier_sidecar

    gguf = open_model(model)
    read_tier_sidecar(sidecar, gguf, build_layout(gguf))


def token_ids(n_vocab: int, n: int, seed: int) -> list[int]:
    """``n`` varied token ids (no byte tokens, no control tokens at the end), fixed by ``seed``."""
    low, high = (256, n_vocab - 3) if n_vocab > 300 else (0, n_vocab)
    return [int(i) for i in np.random.default_rng(seed).integers(low, high, n)]


def page_cache_bytes(path: str) -> int | None:
    """Bytes of ``path`` in the page cache (``mincore`` of a mapping; nothing is read), or None."""
    from aioexperts._io.mapping import PAGE_SIZE, MappedShards  # mincore of a mapping

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        maps = MappedShards([fd], [size])
        try:
            resident, _total = maps.residency(0, 0, size)
        finally:
            maps.close()
    except OSError:
        return None
    finally:
        os.close(fd)
    return resident * PAGE_SIZE


@dataclass
class GenerateConfig:
    """What one ``--mode generate`` invocation runs.

    Attributes:
        model: the GGUF file (both engines read it).
        limits: memory limits as fractions of the model file's size (None: no limit).
        engines: from :data:`ENGINES`.
        rounds: rounds per limit.
        prompt_tokens, decode_tokens: prompt length and decode steps per run.
        threads: llama.cpp's threads (aioexperts uses its bounded compute pool).
        n_ctx: the KV cache positions of both engines.
        run_timeout: seconds before a run is stopped (reported as ``timeout``).
        seed: of the token ids.
        miss_tier: the ``aioexperts-tier`` engine's :class:`~aioexperts.MissTier` fields (``path``
            of the sidecar, ``max_gate_weight``, ``behind_seconds``), else None.
        timeline_path: where the aioexperts engines write a timeline of the decode tokens
            (``--mode timeline``), else None.
        warm_prefill: with no limit, warm every engine with one prefill of the prompt first.
        speculative: the aioexperts engines' ``PrefetchOptions.speculative`` (None: the library's default).
        fio_bytes: under a limit, bytes fio reads after each round for the device's rate (0: none).
    """

    model: str
    limits: Sequence[Fraction | None]
    engines: Sequence[str] = DEFAULT_ENGINES
    rounds: int = 3
    prompt_tokens: int = 256
    decode_tokens: int = 16
    threads: int = 2
    n_ctx: int = 512
    run_timeout: float = 900.0
    seed: int = 0
    notes: list[str] = field(default_factory=list)
    miss_tier: dict[str, Any] | None = None
    timeline_path: str | None = None
    warm_prefill: bool = True
    fio_bytes: int = 1 << 30
    speculative: int | None = None


def _limit_name(limit: Fraction | None) -> str:
    return "none" if limit is None else str(limit)


def run_engine(
    cfg: GenerateConfig,
    engine: str,
    limit: Fraction | None,
    model_bytes: int,
    prompt: list[int],
    decode: list[int],
    tag: str,
) -> dict[str, Any]:
    """One engine run in a child process (inside a fresh cgroup when ``limit``); its events summarised.

    With ``cfg.timeline_path`` the aioexperts engines record a timeline of the decode tokens and
    write it there (``--mode timeline``)."""
    drop_page_cache([cfg.model])
    group = None
    run: dict[str, Any] = {"engine": engine, "limit": _limit_name(limit)}
    if limit is not None:
        run["limit_bytes"] = int(model_bytes * limit)
        group = MemoryCgroup.create(f"aioexperts-bench-{os.getpid()}-{tag}", run["limit_bytes"])
        run["cgroup"] = f"{group.version} {group.path}"
    worker_cfg = {
        "engine": engine,
        "model": cfg.model,
        "prompt": prompt,
        "decode": decode,
        "n_ctx": cfg.n_ctx,
        "threads": cfg.threads,
        "miss_tier": cfg.miss_tier,
        "timeline": cfg.timeline_path,
        "warm_prefill": cfg.warm_prefill and limit is None,
        "speculative": cfg.speculative,
    }
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    events: list[dict[str, Any]] = []
    proc: subprocess.Popen[str] | None = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aioexperts_bench.generate_worker", json.dumps(worker_cfg, allow_nan=False)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=group.join if group is not None else None,  # noqa: PLW1509 - no threads run here
        )
        timed_out = False
        try:
            out, err = proc.communicate(timeout=cfg.run_timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            out, err = proc.communicate()
        run["wall_seconds"] = time.perf_counter() - t0
        for line in out.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "phase" in event:
                events.append(event)
        facts = group.facts() if group is not None else {}
        run["cgroup_facts"] = facts
        run["page_cache_bytes"] = page_cache_bytes(cfg.model)
        code = proc.returncode
        run["returncode"] = code
        done = any(e["phase"] == "done" for e in events)
        if done and code == 0:
            run["status"] = "ok"
        elif timed_out:
            run["status"] = "timeout"
        elif code == -signal.SIGKILL and (facts.get("oom_kills") or 0) > 0:
            run["status"] = "oom-killed"
        elif code == -signal.SIGKILL:
            run["status"] = "killed"
        else:
            run["status"] = "failed"
        if run["status"] != "ok":
            run["stderr_tail"] = err.strip().splitlines()[-5:]
    finally:
        if proc is not None and proc.poll() is None:  # the bench itself is being stopped
            proc.kill()
            proc.wait()
        if group is not None:
            group.remove()
    run.update(_from_events(events, len(prompt)))
    return run


def _run_line(run: dict[str, Any]) -> str:
    """The progress line of one finished run; a run that did not end ``ok`` adds the last line its
    process wrote on stderr (why it failed: an error line, a traceback's last line), if any."""
    line = (
        f"  {run['status']}: {run.get('decode_tok_s') or 0:.3f} tok/s over {run['tokens_decoded']} tokens, "
        f"wall {run['wall_seconds']:.0f} s"
    )
    tail = [text for text in run.get("stderr_tail") or () if text.strip()]
    if run["status"] != "ok" and tail:
        line += f" (stderr: {tail[-1].strip()})"
    return line


def _from_events(events: list[dict[str, Any]], n_prompt: int) -> dict[str, Any]:
    """The run's figures from its worker's event lines."""
    by = {e["phase"]: e for e in events if e["phase"] != "token"}
    tokens = [e for e in events if e["phase"] == "token"]
    out: dict[str, Any] = {"tokens_decoded": len(tokens)}
    if "loaded" in by:
        loaded = by["loaded"]
        out["load_seconds"] = loaded["seconds"]
        for key in (
            "slab_bytes",
            "n_slots",
            "slot_bytes",
            "experts_total",
            "slab_budget",
            "memory_limit_source",
            "backend",
            "fallback_reason",
            "repack",
            "load_mode",
        ):
            if key in loaded:
                out[key] = loaded[key]
    cold = by.get("cold_prefill")
    if cold is not None and cold["seconds"] > 0:
        out["cold_prefill_tok_s"] = n_prompt / cold["seconds"]
    prefill = by.get("prefill")
    if prefill is not None:
        out["prefill_seconds"] = prefill["seconds"]
        out["prefill_tok_s"] = n_prompt / prefill["seconds"] if prefill["seconds"] > 0 else None
        out["ttft_seconds"] = prefill["seconds"]
        out["greedy"] = [prefill["greedy"], *(t["greedy"] for t in tokens)]
    if tokens:
        lat = np.array([t["seconds"] for t in tokens])
        out["token_seconds"] = lat.tolist()
        out["decode_tok_s"] = len(lat) / float(lat.sum())
        out["p5_ms"], out["p50_ms"], out["p95_ms"] = (float(np.percentile(lat, q)) * 1e3 for q in (5, 50, 95))
        start = prefill or tokens[0]
        last = tokens[-1]
        out["major_faults_per_token"] = (last["major_faults"] - start["major_faults"]) / len(tokens)
        out["device_bytes_per_token"] = (last["device_read_bytes"] - start["device_read_bytes"]) / len(tokens)
    if events:
        out["major_faults"] = events[-1]["major_faults"]
        out["peak_rss_bytes"] = max(e["peak_rss_bytes"] for e in events)
        out["device_read_bytes"] = events[-1]["device_read_bytes"]
    done = by.get("done")
    if done is not None:
        for key in ("hit_rate", "expert_bytes_read", "distinct_experts_per_layer", "seconds_per_part"):
            if key in done:
                out[key] = done[key]
        memory = done.get("memory")
        if isinstance(memory, dict) and memory.get("anon_bytes"):  # how much got 2 MiB pages
            out["anon_huge_share"] = memory["anon_huge_bytes"] / memory["anon_bytes"]
        if "fan_out_seconds" in done and tokens:  # issue 33: the decode outside the compiled fan-outs
            out["fan_out_ms_per_token"] = done["fan_out_seconds"] / len(tokens) * 1e3
            total = sum(t["seconds"] for t in tokens)
            out["outside_fan_outs_share"] = max(0.0, 1.0 - done["fan_out_seconds"] / total) if total > 0 else None
        sources = done.get("read_sources")
        if sources and tokens:
            n = len(tokens)
            out["stall_ms_per_token"] = sources["stall_seconds"] / n * 1e3
            sources_keys = ("requests", "cached_hits", "prefetched_in_time", "prefetched_late", "demand_misses")
            for key in (*sources_keys, "low_tier_misses", *TIER_SOURCE_KEYS):
                if key in sources:  # the tier's prefetch figures: runs of this version on
                    out[f"{key}_per_token"] = sources[key] / n
            out["expert_bytes_per_token"] = done.get("expert_bytes_read", 0) / n
            out["device_bytes_per_second"] = sources["device_bytes_per_second"]
    return out


def _agreement(a: list[int] | None, b: list[int] | None) -> dict[str, int] | None:
    if not a or not b:
        return None
    n = min(len(a), len(b))
    return {"agree": sum(int(x == y) for x, y in zip(a[:n], b[:n], strict=True)), "compared": n}


def _round_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """aioexperts over the better llama.cpp run of one round that decoded."""
    ours = next((r for r in runs if r["engine"] == "aioexperts"), None)
    llamas = [r for r in runs if r["engine"] in LLAMA_ENGINES and r.get("decode_tok_s")]
    out: dict[str, Any] = {"llama_statuses": {r["engine"]: r["status"] for r in runs if r["engine"] in LLAMA_ENGINES}}
    tier = next((r for r in runs if r["engine"] == "aioexperts-tier"), None)
    if ours is not None and tier is not None:  # the miss tier against the full-precision model (issue 36)
        out["tier_agreement"] = _agreement(ours.get("greedy"), tier.get("greedy"))
        if ours.get("decode_tok_s") and tier.get("decode_tok_s"):
            out["tier_decode_ratio"] = tier["decode_tok_s"] / ours["decode_tok_s"]
    if ours is None or not llamas:
        statuses = out["llama_statuses"].values()
        out["baseline_failed"] = bool(statuses) and all(x in ("oom-killed", "killed", "failed") for x in statuses)
        return out
    best = max(llamas, key=lambda r: r["decode_tok_s"])
    prefills = [r for r in llamas if r.get("prefill_tok_s")]
    if ours.get("prefill_tok_s") and prefills:
        out["prefill_ratio"] = ours["prefill_tok_s"] / max(r["prefill_tok_s"] for r in prefills)
    out["baseline"] = best["engine"]
    out["baseline_status"] = best["status"]
    if ours.get("outside_fan_outs_share") is not None:
        out["outside_ratio"] = ours["outside_fan_outs_share"]  # a share of the token, not a ratio to llama.cpp
    if ours.get("decode_tok_s"):
        out["decode_ratio"] = ours["decode_tok_s"] / best["decode_tok_s"]
        out["p95_ratio"] = ours["p95_ms"] / best["p95_ms"] if best.get("p95_ms") else None
    out["baseline_faults_per_token"] = best.get("major_faults_per_token")
    out["agreement"] = {r["engine"]: _agreement(ours.get("greedy"), r.get("greedy")) for r in llamas}
    return out


def run_generate_bench(
    cfg: GenerateConfig,
    *,
    note: Callable[[str], None] = lambda s: None,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every limit, round and engine of ``cfg``; the results dictionary (see the module docstring).

    ``checkpoint`` gets the results so far (summary and targets included, ``"complete": False``)
    after every run, so a bench stopped from outside still leaves what it measured.
    """
    from aioexperts import __version__, open_model

    model_bytes = os.path.getsize(cfg.model)
    gguf = open_model(cfg.model)
    n_vocab = gguf.tensors["token_embd.weight"].dims[1] if "token_embd.weight" in gguf.tensors else 0
    prompt = token_ids(n_vocab, cfg.prompt_tokens, cfg.seed)
    decode = token_ids(n_vocab, cfg.decode_tokens, cfg.seed + 1)
    engines = list(cfg.engines)
    reason = llama_unavailable_reason()
    if reason is not None and any(e in LLAMA_ENGINES for e in engines):
        note(reason)
        cfg.notes.append(reason)
        engines = [e for e in engines if e not in LLAMA_ENGINES]
    limits = list(cfg.limits)
    cgroup_reason = unavailable_reason() if any(limit is not None for limit in limits) else None
    if cgroup_reason is not None:
        line = f"memory limits skipped: {cgroup_reason}"
        note(line)
        cfg.notes.append(line)
        limits = [limit for limit in limits if limit is None]
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "aioexperts": __version__,
        "date": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
        "command": "aioexperts-bench " + " ".join(sys.argv[1:]),
        "machine": machine_facts(cfg.model),
        "model": {"path": cfg.model, "name": Path(cfg.model).name, "bytes": model_bytes},
        "parameters": {
            "limits": [_limit_name(x) for x in limits],
            "engines": engines,
            "rounds": cfg.rounds,
            "prompt_tokens": cfg.prompt_tokens,
            "decode_tokens": cfg.decode_tokens,
            "threads": cfg.threads,
            "n_ctx": cfg.n_ctx,
            "run_timeout": cfg.run_timeout,
            "seed": cfg.seed,
            "warm_prefill": cfg.warm_prefill,
            "fio_bytes": cfg.fio_bytes,
            "miss_tier": cfg.miss_tier,
            "speculative": cfg.speculative,
        },
        "cold_method": DROP_METHOD,
        "notes": cfg.notes,
        "runs": [],
        "rounds": [],
    }
    for limit in limits:
        for r in range(cfg.rounds):
            runs = []
            for engine in engines:
                note(f"limit {_limit_name(limit)}, round {r + 1}/{cfg.rounds}: {engine}")
                tag = f"{_limit_name(limit).replace('/', 'of')}-{r}-{engine}"
                run = run_engine(cfg, engine, limit, model_bytes, prompt, decode, tag)
                run["round"] = r
                note(_run_line(run))
                runs.append(run)
                results["runs"].append(run)
                if checkpoint is not None:
                    partial = {**results, "rounds": [*results["rounds"]], "complete": False}
                    if len(runs) == len(engines):
                        partial["rounds"].append({"limit": _limit_name(limit), "round": r, **_round_summary(runs)})
                    checkpoint(_finish(partial))
            summary = {"limit": _limit_name(limit), "round": r, **_round_summary(runs)}
            if limit is not None and cfg.fio_bytes > 0:
                summary["fio"] = fio_rate(cfg.model, cfg.fio_bytes, seed=cfg.seed + r, note=note)
            results["rounds"].append(summary)
    results["complete"] = True
    return _finish(results)


def fio_rate(model: str, n_bytes: int, *, seed: int, note: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """fio's rate on random experts of ``model`` (``n_bytes`` of them, no expert twice, cold, depth 64).

    Returns ``{"gb_s", "bytes", "seconds"}`` (1e9 bytes per second), or ``{"error": why}`` when fio
    is not installed or fails (the round's ``pipeline_ratio`` is then left out)."""
    from aioexperts import build_layout, open_model

    from .fio import FioError, fio_path, run_fio_replay
    from .readlist import expert_read_list

    if fio_path() is None:
        return {"error": "fio is not installed"}
    gguf = open_model(model)
    reads = expert_read_list(gguf, build_layout(gguf), n_bytes, seed=seed)
    drop_page_cache(list(reads.paths))
    try:
        res = run_fio_replay(reads, 64)
    except (FioError, OSError) as exc:
        return {"error": str(exc)}
    rate = res.bytes_read / res.seconds / 1e9 if res.seconds > 0 else None
    note(f"  fio: {res.bytes_read / 1e9:.2f} GB of random experts at {rate or 0:.2f} GB/s")
    return {"gb_s": rate, "bytes": res.bytes_read, "seconds": res.seconds}


def add_pipeline_ratios(results: dict[str, Any]) -> None:
    """Each limited round's ``pipeline_ratio``: decode s/token over max(I/O, compute) (issue 36).

    I/O is aioexperts' expert bytes per token over the round's fio rate; compute is the mean decode
    s/token of aioexperts with no limit in the same results (every expert resident). Left out when
    either is missing."""
    resident = [
        r["decode_tok_s"]
        for r in results["runs"]
        if r["engine"] == "aioexperts" and r["limit"] == "none" and r.get("decode_tok_s")
    ]
    if not resident:
        return
    compute_s = 1.0 / statistics.fmean(resident)
    for rnd in results["rounds"]:
        rate = (rnd.get("fio") or {}).get("gb_s")
        if rnd["limit"] == "none" or not rate:
            continue
        for engine, key in (("aioexperts", "pipeline_ratio"), ("aioexperts-tier", "tier_pipeline_ratio")):
            want = (rnd["limit"], rnd["round"], engine)
            run = next((x for x in results["runs"] if (x["limit"], x["round"], x["engine"]) == want), None)
            if run is None or not run.get("decode_tok_s") or run.get("expert_bytes_per_token") is None:
                continue
            io_s = run["expert_bytes_per_token"] / (rate * 1e9)
            rnd[key] = (1.0 / run["decode_tok_s"]) / max(io_s, compute_s)
            rnd[f"{key}_parts"] = {"io_s": io_s, "compute_s": compute_s, "decode_s": 1.0 / run["decode_tok_s"]}


def _finish(results: dict[str, Any]) -> dict[str, Any]:
    add_pipeline_ratios(results)
    results["summary"] = summarize(results)
    results["targets"] = evaluate_targets(results)
    results["machine"] = {**results["machine"], "load_average_at_end": list(os.getloadavg())}
    return results


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


#: the miss tier's figures of prefetches and upgrades in a run's read sources (issue 36, item 1)
TIER_SOURCE_KEYS = ("low_tier_prefetch_hits", "low_tier_prefetches", "tier_upgrades", "tier_upgrades_deferred")

#: issue 36's figures per decode token (runs of this version on; older results files lack them)
READ_SOURCE_KEYS = (
    "stall_ms_per_token",
    "requests_per_token",
    "cached_hits_per_token",
    "prefetched_in_time_per_token",
    "prefetched_late_per_token",
    "demand_misses_per_token",
    "low_tier_misses_per_token",
    "low_tier_prefetch_hits_per_token",
    "low_tier_prefetches_per_token",
    "tier_upgrades_per_token",
    "tier_upgrades_deferred_per_token",
    "expert_bytes_per_token",
    "device_bytes_per_second",
)


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (limit, engine): the means over rounds of each figure, and the runs' statuses."""
    rows = []
    keys = (
        "decode_tok_s",
        "p5_ms",
        "p50_ms",
        "p95_ms",
        "prefill_tok_s",
        "cold_prefill_tok_s",
        "ttft_seconds",
        "major_faults_per_token",
        "device_bytes_per_token",
        "peak_rss_bytes",
        "page_cache_bytes",
        "hit_rate",
        "slab_bytes",
        *READ_SOURCE_KEYS,
    )
    seen: list[tuple[str, str]] = []
    for run in results["runs"]:
        key = (run["limit"], run["engine"])
        if key not in seen:
            seen.append(key)
    for limit, engine in seen:
        runs = [r for r in results["runs"] if (r["limit"], r["engine"]) == (limit, engine)]
        row: dict[str, Any] = {"limit": limit, "engine": engine, "statuses": [r["status"] for r in runs]}
        for k in keys:
            row[k] = _mean([r[k] for r in runs if r.get(k) is not None])
        distinct = [r["distinct_experts_per_layer"] for r in runs if r.get("distinct_experts_per_layer")]
        if distinct:
            flat = [d for per in distinct for d in per]
            row["distinct_experts_min_mean_max"] = [min(flat), statistics.fmean(flat), max(flat)]
        rows.append(row)
    return rows


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target (:data:`TARGETS`) with its per-round ratios, met or MISSED (or unmeasured)."""
    out = []
    for limit, what, op, threshold in TARGETS:
        rounds = [r for r in results["rounds"] if r["limit"] == limit]
        if not rounds:
            continue
        target = (limit, what, op, threshold)
        if limit == "1/2" and what == "decode":
            faults = [r.get("baseline_faults_per_token") for r in rounds]
            if faults and all(f is not None and f < FITS_FAULTS_PER_TOKEN for f in faults):
                target = FITS_TARGET  # llama.cpp's working set fits: the lower bar of the issue
        values = [r.get(f"{what}_ratio") for r in rounds]
        measured = [v for v in values if v is not None]
        if what == "outside" and not measured:  # results of versions that did not count the fan-outs
            continue
        ours_decoded = {
            (x["limit"], x["round"]) for x in results["runs"] if x["engine"] == "aioexperts" and x.get("decode_tok_s")
        }
        if rounds and all(r.get("baseline_failed") and (limit, r["round"]) in ours_decoded for r in rounds):
            statuses = sorted({s for r in rounds for s in r.get("llama_statuses", {}).values()})
            if statuses == ["oom-killed"]:
                verdict = "met: llama.cpp produced no token in any round (OOM-killed), aioexperts decoded"
            else:  # an assert or a crash says nothing about memory
                verdict = f"unmeasured: llama.cpp produced no token ({', '.join(statuses) or 'failed'})"
        elif not measured:
            verdict = "unmeasured"
        else:
            bar = target[3]
            ok = all((v >= bar) if op == ">=" else (v <= bar) for v in measured)
            verdict = "met" if ok and len(measured) == len(values) else ("MISSED" if not ok else "partly measured")
        out.append(
            {
                "limit": limit,
                "what": what,
                "op": op,
                "threshold": target[3],
                "per_round": values,
                "verdict": verdict,
                "llama_fits": target is FITS_TARGET,
            }
        )
    slabs = [r for r in results["runs"] if r["engine"] == "aioexperts" and r.get("slab_budget")]
    if slabs:
        out.append(
            {
                "limit": "all",
                "what": "slab chosen automatically",
                "op": "",
                "threshold": None,
                "per_round": [r["slab_bytes"] for r in slabs],
                "verdict": "met",
                "llama_fits": False,
            }
        )
    return out
