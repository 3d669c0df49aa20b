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
    table = Table(title="per-expert read rates (payload GB/s = 1e9 bytes/s)")
    for col in ("method", "pass", "GB/s", "experts/s", "p50 ms", "p99 ms", "CPU s/GiB", "x fio", "x mmap"):
        table.add_column(col, justify="left" if col in ("method", "pass") else "right")
    by = {(r.method, r.phase): r for r in results}
    fio = by.get(("fio", "cold"))
    for r in results:
        mm = by.get(("mmap", r.phase))
        table.add_row(
            r.method,
            r.phase,
            f"{r.gb_per_s:.2f}",
            f"{r.experts_per_s:,.0f}",
            _fmt(r.p50_ms, ".2f"),
            _fmt(r.p99_ms, ".2f"),
            f"{r.cpu_s_per_gib:.3f}",
            f"{r.gb_per_s / fio.gb_per_s:.2f}" if fio and r.phase == "cold" else "-",
            f"{r.gb_per_s / mm.gb_per_s:.2f}" if mm else "-",
        )
    console.print(table)
    for r in results:
        if r.note:
            console.print(f"  [dim]{r.method} {r.phase}: {r.note}[/dim]")


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
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    console = Console(stderr=args.json)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        console.print(f"[red]unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}[/red]")
        return 2
    if args.repeat < 1 or args.depth < 1 or (args.tokens is not None and args.tokens < 1):
        console.print("[red]--repeat, --depth and --tokens must be >= 1[/red]")
        return 2
    try:
        path = Path(args.model) if args.model else default_model_path(console, args.rebuild)
        results = run_read_bench(
            os.fspath(path),
            n_tokens=args.tokens,
            seed=args.seed,
            depth=args.depth,
            repeat=args.repeat,
            methods=methods,
            progress=lambda line: console.print(f"[dim]{line}[/dim]"),
        )
    except (AioExpertsError, OSError) as exc:
        console.print(f"[red]error: {exc}[/red]")
        return 1
    if args.json:
        json.dump({"model": os.fspath(path), "reads": [r.as_dict() for r in results]}, sys.stdout, indent=2)
        print()
    else:
        render_reads(results, console)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
