"""``aioexperts-bench``: reproducible figures of aioexperts against fio, a thread pool, pread and mmap.

With no arguments it builds (once, cached) a synthetic model of Qwen3-30B-A3B expert geometry,
runs the read bench and the per-token bench in interleaved rounds, prints the tables, and writes
every raw figure to ``bench-results.json``; ``bench/render.py`` turns that file into the tables
of README.md and docs/bench.md. ``docs/bench.md`` explains every figure.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import importlib.util
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import AioExpertsError, ConfigError, FormatError, IOOptions, __version__
from ..backends import io_uring_unusable_reason, liburing_unusable_reason
from ..testing import bench_model_path, cache_dir, ensure_bench_model, progress_bytes
from ._common import (
    MAX_ROUNDS,
    USAGE_STATUS,
    OneLineParser,
    add_version,
    check_output_path,
    file_starts_with,
    missing_extra,
    model_file,
    refuse_to_overwrite,
    stdout_closed,
    writable_dir,
)

try:
    from rich.console import Console

    from aioexperts_bench import (
        DEFAULT_METHODS,
        DROP_METHOD,
        LOOPS,
        MAX_QUEUE_DEPTH,
        METHODS,
        MIN_QUEUE_DEPTH,
        PLOT_NAMES,
        SCHEMA,
        TARGET_OVERLAP,
        UNITS,
        ReadBenchConfig,
        Reporter,
        TokenBenchConfig,
        await_cost,
        dump_json,
        evaluate_targets,
        kernel_facts,
        load_results,
        machine_facts,
        model_info,
        print_sections,
        run_read_bench,
        run_sweeps,
        run_token_bench,
        split_shard_paths,
        write_plots,
        write_results,
    )
except ModuleNotFoundError as exc:  # the bench extra is optional: one line, not a traceback
    raise missing_extra("aioexperts-bench", exc) from None

#: Read methods that set up an io_uring ring of their own (the store, the raw loops).
URING_METHODS = ("io_uring", "uring", "uring-reused")
#: Of those, the ones that need the ``liburing`` wheel itself (the store also runs on the raw ring).
LIBURING_METHODS = ("uring", "uring-reused")

__all__ = ("build_parser", "main")

#: Below this size a model fits in caches and the figures mean little.
SMALL_MODEL_BYTES = 1 << 30


def _int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``low..high`` (the message names the range and ``what``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in {low}..{high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high} ({what}), got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``aioexperts-bench`` (``--help`` shows every default)."""
    p = OneLineParser(
        prog="aioexperts-bench",
        description="Cold and warm expert reads of aioexperts against fio, a thread pool, buffered pread and "
        "mmap on the same reads, and per-token overlap and tokens/s, in interleaved rounds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", help="a GGUF file or any shard of a split set; None: the built-in model, built once")
    p.add_argument("--rebuild", action="store_true", help="write the built-in model again")
    p.add_argument(
        "--mode",
        choices=("all", "reads", "tokens", "generate", "timeline"),
        default="all",
        help="which benches to run (generate: the whole model against llama.cpp under memory limits; "
        "timeline: decode tokens under a memory limit, per layer, with a picture; `--mode generate --help` "
        "and `--mode timeline --help` list their options)",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; every figure is a median with its range")
    p.add_argument(
        "--depth",
        type=_int_in(MIN_QUEUE_DEPTH, MAX_QUEUE_DEPTH, "an expert is 3 reads; io_uring's ring holds at most 4096"),
        default=64,
        help=f"reads in flight, {MIN_QUEUE_DEPTH}..{MAX_QUEUE_DEPTH}: the store's queue depth and fio iodepth",
    )
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"read methods, from {','.join(METHODS)}")
    p.add_argument("--threads", type=int, default=8, help="threads of the thread-pool and buffered preadv replays")
    p.add_argument("--tokens", type=int, default=None, help="tokens per read pass; None: every expert once")
    p.add_argument("--token-count", type=int, default=16, help="tokens per per-token run")
    p.add_argument("--slab-fraction", type=float, default=0.25, help="slab of the per-token overlap runs")
    p.add_argument("--executor-tokens", type=int, default=4, help="tokens per executor run (0: no executor runs)")
    p.add_argument("--seed", type=int, default=0, help="routing and input seed")
    p.add_argument("--loop", choices=LOOPS, default="uvloop", help="event loop of the store runs")
    p.add_argument("--out", default="bench-results.json", help="results file to write ('' for none)")
    p.add_argument("--plot", metavar="DIR", default=None, help="also run the depth and read-size sweeps; write PNGs")
    p.add_argument("--force", action="store_true", help="let --out and --plot replace files of other kinds")
    p.add_argument("--no-probe", action="store_true", help="skip the host-cache probe")
    p.add_argument("--note", default="", help="a remark stored with the results and shown in the header")
    p.add_argument("--json", action="store_true", help="print the results JSON on stdout instead of tables")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_version(p, "aioexperts-bench")
    return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    reason = io_uring_unusable_reason() if any(m in URING_METHODS for m in methods) else None
    dropped = [m for m in methods if m in URING_METHODS] if reason is not None else []
    if not dropped and any(m in LIBURING_METHODS for m in methods):
        reason = liburing_unusable_reason()
        dropped = [m for m in methods if m in LIBURING_METHODS] if reason is not None else []
    if dropped:
        if args.methods != ",".join(DEFAULT_METHODS):
            parser.error(f"--methods {','.join(dropped)} needs io_uring, but {reason}")
        args._left_out = f"leaving out {', '.join(dropped)}: {reason}"
        methods = [m for m in methods if m not in dropped]
    if not methods:
        parser.error(f"--methods needs at least one of {', '.join(METHODS)}")
    if not 1 <= args.rounds <= MAX_ROUNDS:
        parser.error(f"--rounds must be from 1 to {MAX_ROUNDS}, got {args.rounds}")
    if args.tokens is not None and args.tokens < 1 or args.token_count < 1 or args.threads < 1:
        parser.error("--tokens, --token-count and --threads must be >= 1")
    try:  # the store's own bound on its thread pool
        IOOptions(n_threads=args.threads)
    except ConfigError as exc:
        parser.error(f"--threads: {exc}")
    if args.executor_tokens < 0 or args.seed < 0:
        parser.error("--executor-tokens and --seed must be >= 0")
    if not 0 < args.slab_fraction <= 1:
        parser.error("--slab-fraction must be in (0, 1]")
    if args.rebuild and args.model:
        parser.error("--rebuild writes the built-in model again: it does not go with --model")
    if args.loop == "trio" and importlib.util.find_spec("trio") is None:
        parser.error("--loop trio needs trio: pip install trio")
    return methods


def _inputs(args: argparse.Namespace) -> list[str]:
    """The files a run reads: the model (every shard of a split set) or the built-in model."""
    if not args.model:
        return [os.fspath(bench_model_path())]
    model = os.path.expanduser(args.model)
    try:
        shards = split_shard_paths(model)
    except AioExpertsError:
        shards = None
    return [model, *(shards or [])]


def _is_results_file(path: str) -> bool:
    try:
        load_results(path)
    except (OSError, ValueError, AttributeError):  # AttributeError: JSON that is not an object
        return False
    return True


def _preflight(args: argparse.Namespace) -> str | None:
    """What would make a run fail only once it is done, found before it starts; None if nothing.

    The ``--out`` directory must take a new file, ``--plot`` needs matplotlib and a directory that
    takes files, and building the built-in model needs its cache directory. Neither ``--out`` nor a
    plot may be the model (compared by device and inode), and an existing file is replaced only if
    it is of the kind written there (a results file, a PNG), or with ``--force``.
    """
    if args.model:
        try:
            model_file(args.model)
        except AioExpertsError as exc:
            return str(exc)
    inputs = _inputs(args)
    if args.out:
        out = os.path.abspath(args.out)
        try:
            check_output_path(args.out, "--out")
            refuse_to_overwrite(out, inputs, ours=_is_results_file, force=args.force, what="--out")
        except AioExpertsError as exc:
            return str(exc)
    if args.plot:
        png = file_starts_with(b"\x89PNG\r\n\x1a\n")
        try:
            for name in PLOT_NAMES:
                refuse_to_overwrite(os.path.join(args.plot, name), inputs, ours=png, force=args.force, what="--plot")
        except AioExpertsError as exc:
            return str(exc)
        if importlib.util.find_spec("matplotlib") is None:
            return "--plot needs matplotlib: pip install 'aioexperts[plot]'"
        try:
            os.makedirs(args.plot, exist_ok=True)
        except OSError as exc:
            return f"--plot {args.plot}: cannot create the directory: {exc.strerror or exc}"
        why = writable_dir(args.plot)
        if why:
            return f"--plot {args.plot}: cannot create a file in it: {why}"
    if not args.model and (args.rebuild or not bench_model_path().exists()):
        where = cache_dir()
        try:
            where.mkdir(parents=True, exist_ok=True)
            why = writable_dir(os.fspath(where))
        except OSError as exc:
            why = exc.strerror or str(exc)
        if why:
            return (
                f"cannot write the built-in model into {where}: {why}; set $AIOEXPERTS_CACHE to a writable "
                "directory, or pass --model"
            )
    return None


def _model(args: argparse.Namespace, reporter: Reporter) -> Path:
    if args.model:
        return Path(args.model)

    def on_build(path: Path) -> None:
        reporter.note(f"building the built-in model once -> {path}")

    def on_wait() -> None:
        reporter.note("another aioexperts-bench is building the built-in model; waiting for it")

    last = [-1]

    def progress(done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if pct // 10 != last[0]:
            last[0] = pct // 10
            reporter.note(f"  written {progress_bytes(done, total)}")

    return ensure_bench_model(rebuild=args.rebuild, on_build=on_build, on_wait=on_wait, progress=progress)


def _run(args: argparse.Namespace, methods: list[str], reporter: Reporter) -> dict[str, Any]:
    if getattr(args, "_left_out", None):
        reporter.note(args._left_out)
    path = _model(args, reporter)
    info = model_info(os.fspath(path))
    warnings = []
    if info.file_bytes < SMALL_MODEL_BYTES:
        warnings.append(
            f"the model is {info.file_bytes / 1e9:.2f} GB, under 1 GiB: it fits in caches and the figures mean little"
        )
        reporter.note("warning: " + warnings[-1])
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "aioexperts": __version__,
        "date": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
        "command": "aioexperts-bench " + shlex.join(sys.argv[1:] if args._argv is None else args._argv),
        "units": UNITS,
        "machine": machine_facts(os.fspath(path)),
        "model": {
            "path": os.fspath(path),
            "name": path.name,
            "builtin": not args.model,
            "bytes": info.file_bytes,
            "experts": info.n_experts_total,
            "layers": len(info.layers),
            "top_k": info.n_expert_used,
            "expert_bytes": max(info.expert_bytes.values()),
        },
        "parameters": {k: v for k, v in vars(args).items() if not k.startswith("_")} | {"methods": methods},
        "cold_method": DROP_METHOD,
        "warnings": warnings,
        "note": args.note,
    }
    do_reads = args.mode in ("all", "reads")
    do_tokens = args.mode in ("all", "tokens")
    rcfg = ReadBenchConfig(
        depth=args.depth,
        rounds=args.rounds,
        methods=tuple(methods),
        n_threads=args.threads,
        seed=args.seed,
        n_tokens=args.tokens,
        loop=args.loop,
        probe_bytes=0 if args.no_probe else 256 << 20,
    )
    tcfg = TokenBenchConfig(
        rounds=args.rounds,
        n_tokens=args.token_count,
        slab_fraction=args.slab_fraction,
        depth=args.depth,
        seed=args.seed,
        loop=args.loop,
        executor_tokens=args.executor_tokens,
        target_overlap=TARGET_OVERLAP,
    )
    n_methods = len(methods)
    steps = 0
    if do_reads:
        steps += 2 + args.rounds * n_methods
    if do_tokens:
        steps += 1 + args.rounds * (4 + (len(tcfg.executor_fractions) if args.executor_tokens else 0))
    steps += 1
    reporter.start(steps)
    if do_reads:
        results["reads"] = run_read_bench(os.fspath(path), rcfg, step=reporter.step, note=reporter.note)
    if do_tokens:
        results["tokens"] = run_token_bench(os.fspath(path), tcfg, step=reporter.step, note=reporter.note)
    reporter.step("per-await cost of each event loop")
    results["loops"] = _loops(reporter)
    if args.plot:
        results["sweep"] = run_sweeps(os.fspath(path), rcfg, note=reporter.note)
    results["kernels"] = kernel_facts()
    results["targets"] = evaluate_targets(results)
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    return results


def _loops(reporter: Reporter) -> dict[str, Any]:
    out = {}
    for loop in LOOPS:
        try:
            out[loop] = await_cost(loop)
        except ImportError as exc:
            reporter.note(f"{loop}: not measured ({exc})")
    return out


def _save_elsewhere(results: dict[str, Any]) -> str | None:
    """Write ``results`` to a new file in the temporary directory; its path, or None if that fails too."""
    try:
        fd, path = tempfile.mkstemp(prefix="aioexperts-bench-results-", suffix=".json")
        os.close(fd)
        write_results(path, results)
    except OSError:
        return None
    return path


class _Console(Console):
    """rich's console, letting a closed stdout raise ``BrokenPipeError`` (rich itself exits with status 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def _error(text: str) -> None:
    print(f"aioexperts-bench: error: {text}", file=sys.stderr, flush=True)


def _own_mode(words: list[str]) -> str | None:
    """``generate`` or ``timeline`` when ``--mode`` names one of the modes with a command line of its own."""
    for i, w in enumerate(words):
        value = (
            w.partition("=")[2]
            if w.startswith("--mode=")
            else words[i + 1]
            if w == "--mode" and i + 1 < len(words)
            else None
        )
        if value in ("generate", "timeline"):
            return value
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code.

    0: done; 1: the run failed, or it finished but its results file or plots could not be written
    (the tables are printed all the same); 2: bad arguments, a ``--model`` file that is missing, a
    directory or unreadable, or an ``--out``/``--plot``/cache directory that cannot be written, found
    before the run; 130: interrupted; 141: stdout is a
    closed pipe. Errors go to stderr, one line each.
    """
    words = sys.argv[1:] if argv is None else argv
    mode = _own_mode(list(words))
    if mode == "generate":
        from .bench_generate import main as generate_main

        return generate_main(list(words))
    if mode == "timeline":
        from .bench_timeline import main as timeline_main

        return timeline_main(list(words))
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = argv
    methods = _check(parser, args)
    problem = _preflight(args)
    if problem:
        _error(problem)
        return USAGE_STATUS
    reporter = Reporter(quiet=args.quiet)
    try:
        results = _run(args, methods, reporter)
    except KeyboardInterrupt:
        reporter.stop()
        print("aioexperts-bench: interrupted; nothing was written", file=sys.stderr)
        return 130
    except FormatError as exc:  # the model file itself is malformed
        reporter.stop()
        hint = (
            ""
            if args.model
            else f" (the built-in model may be damaged: run again with --rebuild; it is in {cache_dir()})"
        )
        _error(f"{exc}{hint}")
        return USAGE_STATUS if args.model else 1  # a file the user named is bad input, as in every command
    except (AioExpertsError, OSError) as exc:
        reporter.stop()
        _error(str(exc))
        return 1
    reporter.stop()
    status, written = 0, None
    try:
        if args.out:
            try:
                write_results(args.out, results)
                written = args.out
            except OSError as exc:
                written = _save_elsewhere(results)
                instead = f"; saved them to {written} instead" if written else ""
                _error(f"cannot write the results file {args.out}: {exc}{instead}")
                status = 1
        if args.plot:
            try:
                for png in write_plots(results, args.plot):
                    reporter.note(f"wrote {png}")
            except (AioExpertsError, OSError) as exc:
                _error(f"cannot write the plots into {args.plot}: {exc}")
                status = 1
    except KeyboardInterrupt:
        done = f"the results are in {written}" if written else "nothing was written"
        print(f"aioexperts-bench: interrupted; {done}", file=sys.stderr)
        return 130
    try:
        if args.json:
            dump_json(results, sys.stdout, indent=1)  # strict: NaN and inf become null
            print()
        else:
            console = _Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)
            print_sections(results, console)
            if written:
                console.print(
                    f"\nresults: {written} (in a clone of aioexperts, `make render RESULTS={shlex.quote(written)}` "
                    "renders the tables of README.md and docs/ from it)",
                    highlight=False,
                    markup=False,
                    soft_wrap=True,
                )
        sys.stdout.flush()
    except BrokenPipeError:
        return stdout_closed()
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
