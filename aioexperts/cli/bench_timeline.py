"""``aioexperts-bench --mode timeline``: a timeline of decode tokens under a memory limit, and its picture.

See :mod:`aioexperts_bench.timeline` for what runs and what is recorded, and docs/bench.md ("A
timeline of decode tokens") for how to read the picture. The memory limit needs a cgroup the bench
can create (root, cgroup v1 or v2 with the memory controller); where it cannot, the run goes
without one and says so.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from aioexperts_bench import (
    TIMELINE_SCHEMA,
    TimelineConfig,
    parse_limit,
    render_timeline_svg,
    run_timeline_bench,
    timeline_report,
    write_text,
)

from .. import AioExpertsError
from .._json import dumps as json_dumps
from ._common import (
    OneLineParser,
    add_version,
    check_output_path,
    error_text,
    file_starts_with,
    refuse_to_overwrite,
)
from .bench_generate import _model as built_in_model
from .bench_generate import (
    add_model_arguments,
    check_limits,
    check_miss_tier_file,
    check_model_arguments,
    model_file_error,
    usage_error,
)

__all__ = ("build_parser", "main")

ENGINES = ("aioexperts", "aioexperts-int8", "aioexperts-tier")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``aioexperts-bench --mode timeline``."""
    p = OneLineParser(
        prog="aioexperts-bench --mode timeline",
        description="Decode tokens of aioexperts under a memory limit with a timeline recorded (per MoE layer: "
        "reads submitted and completed, compute, stalls); writes a results JSON and an SVG picture.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--mode", choices=("timeline",), default="timeline", help=argparse.SUPPRESS)
    add_model_arguments(p)
    p.add_argument("--limit", default="1/4", help="memory limit: none, or a fraction in (0, 4] of the model's size")
    p.add_argument("--engine", choices=ENGINES, default="aioexperts", help="the aioexperts engine of --mode generate")
    p.add_argument("--miss-tier", default=None, help="the miss tier's sidecar (engine aioexperts-tier)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt prefilled in one batch (not recorded)")
    p.add_argument("--decode-tokens", type=int, default=8, help="decode tokens recorded")
    p.add_argument("--picture-tokens", type=int, default=4, help="decode tokens drawn in the picture")
    p.add_argument("--n-ctx", type=int, default=None, help="KV cache positions (default prompt + decode + 16)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds before the run is stopped")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids")
    p.add_argument(
        "--speculative",
        type=int,
        default=None,
        help="MoE layers read speculatively beyond the prefetch depth (PrefetchOptions.speculative; default: the "
        "library's)",
    )
    p.add_argument("--out", default="bench-timeline.json", help="results file to write")
    p.add_argument("--svg", default=None, help="the picture (default: --out with .svg)")
    p.add_argument("--force", action="store_true", help="let --out and --svg replace files of another kind")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_version(p, "aioexperts-bench")
    return p


def _is_results(path: str) -> bool:
    import json

    try:
        with open(path) as f:
            return bool(json.load(f).get("schema") == TIMELINE_SCHEMA)
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    """Entry point; 0 done, 1 the run failed (the files are written all the same), 2 bad arguments or a bad
    ``--model`` file (before any run)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        limit = parse_limit(args.limit)
    except (ValueError, ZeroDivisionError) as exc:
        parser.error(f"--limit: {exc}")
    for name in ("prompt_tokens", "decode_tokens", "picture_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_model_arguments(parser, args)
    n_ctx = args.n_ctx or args.prompt_tokens + args.decode_tokens + 16
    if n_ctx < args.prompt_tokens + args.decode_tokens:
        parser.error(f"--n-ctx {n_ctx} is less than --prompt-tokens + --decode-tokens")
    if args.speculative is not None and args.speculative < 0:
        parser.error(f"--speculative must be >= 0, got {args.speculative}")
    if not args.run_timeout > 0:
        parser.error(f"--run-timeout must be > 0 seconds, got {args.run_timeout}")
    if (args.engine == "aioexperts-tier") != (args.miss_tier is not None):
        parser.error("--engine aioexperts-tier and --miss-tier go together")
    if not args.out:
        parser.error("--out must name the results file")
    if args.picture_tokens > args.decode_tokens:
        parser.error(f"--picture-tokens {args.picture_tokens} is more than --decode-tokens {args.decode_tokens}")
    if (status := model_file_error(args)) is not None:
        return status
    svg = args.svg or os.path.splitext(args.out)[0] + ".svg"

    def check_outputs() -> None:
        check_output_path(args.out, "--out")
        check_output_path(svg, "--svg")

    if (status := usage_error(check_outputs)) is not None:
        return status

    def note(text: str) -> None:
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM: the cgroup is removed on the way out

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        model = built_in_model(args, note)
        out = os.path.abspath(args.out)

        def check_against_the_model() -> None:
            refuse_to_overwrite(out, [model], ours=_is_results, force=args.force, what="--out")
            refuse_to_overwrite(
                os.path.abspath(svg), [model], ours=file_starts_with(b"<svg"), force=args.force, what="--svg"
            )
            check_miss_tier_file(args.miss_tier, model)
            check_limits([limit], model)

        if (status := usage_error(check_against_the_model)) is not None:
            return status
        tier = None
        if args.miss_tier is not None:
            tier = {"path": os.path.abspath(args.miss_tier), "max_gate_weight": None, "behind_seconds": None}
        cfg = TimelineConfig(
            model=model,
            limit=limit,
            engine=args.engine,
            prompt_tokens=args.prompt_tokens,
            decode_tokens=args.decode_tokens,
            n_ctx=n_ctx,
            run_timeout=args.run_timeout,
            seed=args.seed,
            miss_tier=tier,
            speculative=args.speculative,
        )
        results = run_timeline_bench(cfg, note=note)
        results["parameters"]["picture_tokens"] = args.picture_tokens
    except KeyboardInterrupt:
        print("aioexperts-bench: interrupted; nothing was written", file=sys.stderr)
        return 130
    except (AioExpertsError, OSError) as exc:
        print(f"aioexperts-bench: error: {error_text(exc)}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        write_text(out, json_dumps(results, indent=1) + "\n")
        write_text(svg, render_timeline_svg(results, tokens=args.picture_tokens))
    except OSError as exc:
        print(f"aioexperts-bench: error: {error_text(exc)}", file=sys.stderr)
        return 1
    print(timeline_report(results))
    print(f"results: {args.out}; picture: {svg}")
    if results["run"]["status"] != "ok" or not results.get("summary"):
        print("aioexperts-bench: the run did not complete (see above)", file=sys.stderr)
        return 1
    return 0
