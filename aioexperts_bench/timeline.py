"""``aioexperts-bench --mode timeline``: a timeline of decode tokens under a memory limit.

One aioexperts run of ``--mode generate``'s protocol (its own process, inside a memory cgroup of
a fraction of the model file's size when the bench can make one, the model's page cache dropped
first): prefill a prompt, then decode tokens one at a time, the runner recording an
:class:`aioexperts.Timeline` of the decode tokens (every expert load: queued, submitted, completed;
every MoE layer step: started, had its experts, its compute jobs, ended, the seconds it stalled on
reads). The results: the run's figures (as ``--mode generate``), the timeline's columns, its
summary (device busy fraction, compute busy fraction, stall seconds per token, decode time over
``max(I/O, compute)``) and per-layer means; :func:`render_svg` draws the picture (docs/bench.md,
"A timeline of decode tokens").
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .cachestate import DROP_METHOD
from .cgroup import unavailable_reason
from .generate import GenerateConfig, run_engine, token_ids
from .machine import machine_facts

__all__ = ("TIMELINE_SCHEMA", "TimelineConfig", "per_layer", "run_timeline_bench", "summary_line", "timeline_report")

TIMELINE_SCHEMA = "aioexperts-bench-timeline/1"


@dataclass
class TimelineConfig:
    """What one ``--mode timeline`` run does.

    Attributes:
        model: the GGUF file.
        limit: the memory limit as a fraction of the model file's size (None: no limit).
        engine: ``aioexperts`` (or ``aioexperts-int8``, ``aioexperts-tier`` with ``miss_tier``).
        prompt_tokens, decode_tokens: prompt length and decode tokens recorded.
        n_ctx: KV cache positions.
        run_timeout: seconds before the run is stopped.
        seed: of the token ids.
        miss_tier: the ``aioexperts-tier`` engine's MissTier fields, else None.
        speculative: ``PrefetchOptions.speculative`` (None: the library's default).
    """

    model: str
    limit: Fraction | None = Fraction(1, 4)
    engine: str = "aioexperts"
    prompt_tokens: int = 16
    decode_tokens: int = 8
    n_ctx: int = 64
    run_timeout: float = 900.0
    seed: int = 0
    miss_tier: dict[str, Any] | None = None
    speculative: int | None = None


def run_timeline_bench(cfg: TimelineConfig, *, note: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run the engine once with the timeline on; the results dictionary (module docstring).

    Without a usable memory cgroup the run goes without a limit, and ``notes`` says so.
    """
    from aioexperts import __version__, open_model

    notes: list[str] = []
    limit = cfg.limit
    if limit is not None:
        reason = unavailable_reason()
        if reason is not None:
            notes.append(f"no memory limit: {reason}")
            note(notes[-1])
            limit = None
    model_bytes = os.path.getsize(cfg.model)
    gguf = open_model(cfg.model)
    n_vocab = gguf.tensors["token_embd.weight"].dims[1] if "token_embd.weight" in gguf.tensors else 0
    prompt = token_ids(n_vocab, cfg.prompt_tokens, cfg.seed)
    decode = token_ids(n_vocab, cfg.decode_tokens, cfg.seed + 1)
    fd, path = tempfile.mkstemp(prefix="aioexperts-timeline-", suffix=".json")
    os.close(fd)
    try:
        gcfg = GenerateConfig(
            model=cfg.model,
            limits=[limit],
            engines=[cfg.engine],
            rounds=1,
            prompt_tokens=cfg.prompt_tokens,
            decode_tokens=cfg.decode_tokens,
            n_ctx=cfg.n_ctx,
            run_timeout=cfg.run_timeout,
            seed=cfg.seed,
            miss_tier=cfg.miss_tier,
            timeline_path=path,
            speculative=cfg.speculative,
        )
        limit_name = "none" if limit is None else str(limit)
        note(f"{cfg.engine}, limit {limit_name}: {cfg.prompt_tokens} prompt tokens, {cfg.decode_tokens} decode tokens")
        run = run_engine(gcfg, cfg.engine, limit, model_bytes, prompt, decode, f"timeline-{os.getpid()}")
        try:
            with open(path) as f:
                timeline = json.load(f) if os.path.getsize(path) else None
        except (OSError, ValueError):
            timeline = None
    finally:
        os.unlink(path)
    note(f"  {run['status']}: {run.get('decode_tok_s') or 0:.3f} tok/s over {run['tokens_decoded']} tokens")
    return {
        "schema": TIMELINE_SCHEMA,
        "aioexperts": __version__,
        "date": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
        "command": "aioexperts-bench " + " ".join(sys.argv[1:]),
        "machine": machine_facts(cfg.model) | {"load_average_at_end": list(os.getloadavg())},
        "model": {"path": cfg.model, "name": Path(cfg.model).name, "bytes": model_bytes},
        "parameters": {
            "limit": "none" if cfg.limit is None else str(cfg.limit),
            "limit_applied": limit_name,
            "engine": cfg.engine,
            "prompt_tokens": cfg.prompt_tokens,
            "decode_tokens": cfg.decode_tokens,
            "n_ctx": cfg.n_ctx,
            "seed": cfg.seed,
            "speculative": cfg.speculative,
        },
        "cold_method": DROP_METHOD,
        "notes": notes,
        "run": run,
        "timeline": timeline,
        "summary": None if timeline is None else timeline["summary"],
        "per_layer": None if timeline is None else per_layer(timeline),
    }


def _col(table: dict[str, list[Any]], name: str) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in table.get(name, [])], np.float64)


def per_layer(timeline: dict[str, Any]) -> list[dict[str, Any]]:
    """Per MoE layer, over the recorded tokens: reads per token and the mean read time (submitted to
    completed), and per layer step the mean wait for its experts, stall and expert compute (ms)."""
    reads, steps, computes = timeline["reads"], timeline["steps"], timeline["computes"]
    n_tokens = max(1, len(timeline["tokens"]["start_ms"]))
    r_layer, r_sub, r_done = _col(reads, "layer"), _col(reads, "submitted_ms"), _col(reads, "done_ms")
    s_layer, s_start, s_ready = _col(steps, "layer"), _col(steps, "start_ms"), _col(steps, "ready_ms")
    s_stall = _col(steps, "stall_ms")
    c_layer, c_start, c_end = _col(computes, "layer"), _col(computes, "start_ms"), _col(computes, "end_ms")
    out = []
    for layer in timeline.get("layers") or sorted({int(v) for v in s_layer}):
        r, s, c = r_layer == layer, s_layer == layer, c_layer == layer
        n_steps = int(s.sum())
        out.append(
            {
                "layer": int(layer),
                "reads_per_token": float(r.sum()) / n_tokens,
                "read_ms_mean": float(np.mean(r_done[r] - r_sub[r])) if r.any() else None,
                "wait_ms_mean": float(np.mean(s_ready[s] - s_start[s])) if n_steps else None,
                "stall_ms_mean": float(np.mean(s_stall[s])) if n_steps else None,
                "compute_ms_mean": float(np.sum(c_end[c] - c_start[c]) / n_steps) if n_steps else None,
            }
        )
    return out


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def summary_line(s: dict[str, Any]) -> str:
    """One line of a timeline's summary (:meth:`aioexperts.Timeline.summary`)."""
    per_token, stall = _fmt(s.get("seconds_per_token"), ".1f", 1e3), _fmt(s.get("stall_seconds_per_token"), ".1f", 1e3)
    busy, compute = _fmt(s.get("device_busy_fraction"), ".0%"), _fmt(s.get("compute_busy_fraction"), ".0%")
    experts, ratio = _fmt(s.get("expert_compute_fraction"), ".0%"), _fmt(s.get("pipeline_ratio"), ".2f")
    return (
        f"per token {per_token} ms: stall {stall} ms, {_fmt(s.get('bytes_per_token'), '.1f', 1e-6)} MB read; "
        f"device busy {busy}, compute busy {compute} (expert jobs {experts}); decode / max(I/O, compute) = {ratio}"
    )


def timeline_report(results: dict[str, Any]) -> str:
    """Plain-text lines: the run, the summary and the layers that stalled most."""
    run, s = results["run"], results.get("summary") or {}
    p = results["parameters"]
    lines = [
        f"aioexperts-bench --mode timeline: {results['model']['name']}, {p['engine']}, limit {p['limit_applied']}, "
        f"{run['status']}, {run.get('tokens_decoded', 0)} decode tokens at {_fmt(run.get('decode_tok_s'), '.3f')} tok/s"
    ]
    lines += [f"note: {n}" for n in results.get("notes", [])]
    if not s.get("tokens"):
        lines.append("no timeline recorded" + (f": {run.get('stderr_tail')}" if run.get("stderr_tail") else ""))
        return "\n".join(lines)
    lines.append(summary_line(s))
    layers = sorted(results.get("per_layer") or [], key=lambda r: -(r["stall_ms_mean"] or 0.0))[:5]
    if layers:
        worst = ", ".join(f"{r['layer']} ({_fmt(r['stall_ms_mean'], '.1f')} ms)" for r in layers)
        lines.append(f"layers that stalled most (mean stall per step): {worst}")
    return "\n".join(lines)
