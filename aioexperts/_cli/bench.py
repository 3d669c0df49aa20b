"""``aioexperts-bench``: measure how fast experts stream from a GGUF file, against the baselines.

With no arguments it builds (once, cached) a synthetic model of Qwen3-30B-A3B expert geometry and
measures cold and warm per-expert read rates of aioexperts and of the usual alternatives.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .. import __version__
from .._errors import AioExpertsError
from .readbench import PassResult, run_read_bench
from .synthetic import BENCH_SPEC, write_synthetic_model
from .tokenbench import TokenBenchResult, TokenRun, run_token_bench

__all__ = ("default_model_path", "main")

METHODS = ("fio", "io_uring", "threads", "buffered", "mmap")
_BENCH_NAME = "qwen3-30b-a3b-geometry-q4_k-8l-v1.gguf"


def cache_dir() -> Path:
    """``$AIOEXPERTS_CACHE``, else ``$XDG_CACHE_HOME/aioexperts``, else ``~/.cache/aioexperts``."""
    explicit = os.environ.get("AIOEXPERTS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aioexperts"


def default_model_path(console: Console, rebuild: bool = False) -> Path:
    """The bench model, built on first use (with a progress bar) under :func:`cache_dir`."""
    path = cache_dir() / _BENCH_NAME
    if path.exists() and not rebuild:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial.gguf")
    spec = BENCH_SPEC
    console.print(
        f"building the bench model once: {spec.n_layer} MoE layers x {spec.n_expert} experts, "
        f"n_embd {spec.n_embd}, n_ff {spec.n_ff}, {spec.expert_type.name} -> {path}"
    )
    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("writing", total=None)
        write_synthetic_model(tmp, spec, progress=lambda done, total: bar.update(task, completed=done, total=total))
    os.replace(tmp, path)
    return path


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_reads(results: list[PassResult], console: Console) -> None:
    """Print the read-rate table and the ratios to fio and to mmap."""
    table = Table(title="per-expert read rates (payload GB/s = 1e9 bytes/s; median and range over the repeats)")
    for col in (
        "method",
        "pass",
        "GB/s",
        "range",
        "experts/s",
        "p50 ms",
        "p99 ms",
        "CPU s/GiB",
        "x fio",
        "x mmap",
    ):
        table.add_column(col, justify="left" if col in ("method", "pass") else "right", no_wrap=True)
    by = {(r.method, r.phase): r for r in results}
    fio = by.get(("fio", "cold"))
    for r in results:
        mm = by.get(("mmap", r.phase))
        table.add_row(
            r.method,
            r.phase,
            f"{r.gb_per_s:.2f}",
            f"{r.gb_per_s_range[0]:.2f}-{r.gb_per_s_range[1]:.2f}" if r.gb_per_s_range else "-",
            f"{r.experts_per_s:,.0f}",
            _fmt(r.p50_ms, ".2f"),
            _fmt(r.p99_ms, ".2f"),
            f"{r.cpu_s_per_gib:.3f}",
            f"{r.gb_per_s / fio.gb_per_s:.2f}" if fio and r.phase == "cold" else "-",
            f"{r.gb_per_s / mm.gb_per_s:.2f}" if mm else "-",
        )
    console.print(table)
    if fio is None and any(r.method.startswith("aioexperts") for r in results):
        console.print("  [dim]fio is not installed: the device's own limit was not measured (install fio)[/dim]")
    for r in results:
        if r.note:
            console.print(f"  [dim]{r.method} {r.phase}: {r.note}[/dim]")


def render_tokens(result: TokenBenchResult, console: Console) -> None:
    """Print the per-token tables: runs, overlap, policies and the trace replay."""
    title = (
        f"per-token pipeline ({result.compute} compute, slab {result.slots} of {result.n_experts_total} experts, "
        f"median of {result.repeat})"
    )
    table = Table(title=title)
    for col in (
        "run",
        "tok/s",
        "ms/token",
        "p50 ms",
        "p99 ms",
        "I/O wait ms",
        "compute ms",
        "hit rate",
        "prefetch hits",
    ):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)

    def row(r: TokenRun) -> None:
        table.add_row(
            r.name,
            f"{r.tokens_per_s:.2f}",
            f"{r.ms_per_token:.1f}",
            f"{r.p50_ms:.1f}",
            f"{r.p99_ms:.1f}",
            f"{r.io_wait_s / r.tokens * 1e3:.1f}",
            f"{r.compute_s / r.tokens * 1e3:.1f}",
            f"{r.hit_rate:.1%}",
            f"{r.prefetch_hits}/{r.requests}",
        )

    for r in result.runs:
        row(r)
    console.print(table)
    console.print(
        f"I/O alone {result.io_ms_per_token:.1f} ms/token, compute alone {result.compute_ms_per_token:.1f} ms/token; "
        f"overlap = pipelined token time / max(I/O, compute) = [bold]{result.overlap:.2f}[/bold] "
        "(1.0: fully hidden; 2.0: no overlap)"
    )
    console.print(
        f"  against the I/O time with one core busy elsewhere ({result.io_loaded_ms_per_token:.1f} ms/token): "
        f"{result.overlap_loaded:.2f}"
    )
    for name, value in result.other_overlaps.items():
        console.print(f"  overlap with {name.split('compute ')[1]}: {value:.2f}")
    policies = Table(title="eviction policies on a skewed trace (no prefetch)")
    for col in ("policy", "tok/s", "hit rate"):
        policies.add_column(col, justify="left" if col == "policy" else "right")
    for r in result.policy_runs:
        policies.add_row(r.name.split()[1], f"{r.tokens_per_s:.2f}", f"{r.hit_rate:.1%}")
    console.print(policies)
    replay = Table(title="trace replay: hit rate by slab size (Belady = optimal)")
    names = list(next(iter(next(iter(result.replay.values())).values())))
    for col in ("trace", "slab", *names):
        replay.add_column(col, justify="left" if col == "trace" else "right")
    for trace_name, by_fraction in result.replay.items():
        for fraction, by_policy in by_fraction.items():
            replay.add_row(trace_name, f"{fraction:.0%}", *(f"{by_policy[n].hit_rate:.1%}" for n in names))
    console.print(replay)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``aioexperts-bench``."""
    p = argparse.ArgumentParser(
        prog="aioexperts-bench",
        description="Measure cold and warm per-expert read rates of aioexperts against fio, mmap and pread.",
    )
    p.add_argument("--model", help="a GGUF file or any shard of a split set (default: the built-in bench model)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the built-in bench model")
    p.add_argument("--tokens", type=int, help="tokens per pass (default: every expert read once per pass)")
    p.add_argument("--seed", type=int, default=0, help="routing seed (default 0)")
    p.add_argument("--depth", type=int, default=64, help="reads in flight: engine queue depth and fio iodepth")
    p.add_argument("--repeat", type=int, default=3, help="runs per method; the median is reported (default 3)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument(
        "--mode",
        choices=("reads", "tokens", "all"),
        default="reads",
        help="reads: per-expert read rates (default); tokens: per-token pipeline; all: both",
    )
    p.add_argument(
        "--compute",
        choices=("synthetic", "executor"),
        default="synthetic",
        help="tokens mode: a synthetic compute step as long as the I/O, or the real numpy executor",
    )
    p.add_argument("--slab-fraction", type=float, default=0.25, help="tokens mode: slab size / all experts")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if not methods:
        parser.error(f"--methods needs at least one of {', '.join(METHODS)}")
    if args.repeat < 1 or args.depth < 3 or (args.tokens is not None and args.tokens < 1):
        parser.error("--repeat and --tokens must be >= 1, --depth >= 3 (an expert is 3 reads)")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    if not 0 < args.slab_fraction <= 1:
        parser.error("--slab-fraction must be in (0, 1]")
    stream = sys.stderr if args.json else sys.stdout
    console = Console(file=stream, width=None if stream.isatty() else 132)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    say = lambda line: console.print(f"[dim]{line}[/dim]")  # noqa: E731
    out: dict[str, object] = {}
    try:
        path = Path(args.model) if args.model else default_model_path(console, args.rebuild)
        out["model"] = os.fspath(path)
        if args.mode in ("reads", "all"):
            reads = run_read_bench(
                os.fspath(path),
                n_tokens=args.tokens,
                seed=args.seed,
                depth=args.depth,
                repeat=args.repeat,
                methods=methods,
                progress=say,
            )
            out["reads"] = [r.as_dict() for r in reads]
            if not args.json:
                render_reads(reads, console)
        if args.mode in ("tokens", "all"):
            tokens = run_token_bench(
                os.fspath(path),
                n_tokens=args.tokens or 24,
                seed=args.seed,
                slab_fraction=args.slab_fraction,
                depth=args.depth,
                compute=args.compute,
                repeat=args.repeat,
                progress=say,
            )
            out["tokens"] = _token_json(tokens)
            if not args.json:
                render_tokens(tokens, console)
    except (AioExpertsError, OSError) as exc:
        console.print(f"[red]error: {exc}[/red]")
        if not args.model:
            console.print("(the built-in model may be damaged: run again with --rebuild)")
        return 1
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
    return 0


def _token_json(result: TokenBenchResult) -> dict[str, object]:
    def run(r: TokenRun) -> dict[str, object]:
        d = dict(vars(r))
        d.update(tokens_per_s=r.tokens_per_s, ms_per_token=r.ms_per_token)
        return d

    return {
        "compute": result.compute,
        "slots": result.slots,
        "n_experts_total": result.n_experts_total,
        "io_ms_per_token": result.io_ms_per_token,
        "compute_ms_per_token": result.compute_ms_per_token,
        "overlap": result.overlap,
        "other_overlaps": result.other_overlaps,
        "io_loaded_ms_per_token": result.io_loaded_ms_per_token,
        "overlap_loaded": result.overlap_loaded,
        "runs": [run(r) for r in result.runs],
        "policies": [run(r) for r in result.policy_runs],
        "replay": {
            trace: {str(f): {p: r.hit_rate for p, r in by.items()} for f, by in fr.items()}
            for trace, fr in result.replay.items()
        },
    }


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
