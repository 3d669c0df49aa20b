"""``aioexperts-bench --mode generate``: decode and prefill of aioexperts against llama.cpp under memory limits.

See :mod:`aioexperts_bench.generate` for what runs and what is measured, and docs/bench.md
("Generate under memory limits") for how to read the table. llama.cpp comes from the optional
``baseline`` extra (llama-cpp-python, which compiles llama.cpp: about 7 minutes on 2 cores); without
it the bench says so in one line and runs aioexperts alone. Memory limits need a cgroup the bench
can create (root, cgroup v1 or v2 with the memory controller); where it cannot, it says so and runs
the unlimited case only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from fractions import Fraction

from aioexperts_bench import (
    DEFAULT_ENGINES,
    ENGINES,
    GenerateConfig,
    check_sidecar,
    parse_limit,
    run_generate_bench,
    text_report,
    write_text,
)

from .. import AioExpertsError, ConfigError, open_model, write_miss_tier
from .._json import dumps as json_dumps
from ._common import (
    MAX_ROUNDS,
    USAGE_STATUS,
    OneLineParser,
    add_version,
    cache_error,
    check_output_path,
    error_text,
    gate_weight,
    model_file,
    plural,
    refuse_to_overwrite,
    sidecar_file_problem,
)
from .tiertool import TYPES as TIER_TYPES
from .tiertool import default_output

__all__ = ("DSV4_NAME", "add_model_arguments", "build_parser", "check_model_arguments", "main")

#: ``--model dsv4-flash``: the built-in DeepSeek-V4-Flash-geometry model (aioexperts.testing.ensure_dsv4_model).
DSV4_NAME = "dsv4-flash"
#: the smallest memory limit a run is made under (the interpreter, numpy and numba alone take more)
MIN_LIMIT_BYTES = 256 << 20


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--layers`` and ``--routing`` (``--mode generate`` and ``--mode timeline``)."""
    p.add_argument(
        "--model",
        help=f"a whole-model GGUF file, or {DSV4_NAME!r}: the built-in DeepSeek-V4-Flash-geometry model "
        "(deepseek4, 256 experts of Q2_K per layer, top-6; --layers, default 4: about 9.1 GB); "
        "None: the built-in Qwen3-30B-A3B-geometry full model (--layers, default 48: about 17 GB; --routing)",
    )
    p.add_argument("--layers", type=int, default=None, help="layers of the built-in model (None: 48, dsv4-flash 4)")
    p.add_argument(
        "--routing", choices=("spread", "skewed"), default=None, help="the built-in Qwen3 model's routers (spread)"
    )


def check_model_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 (``parser.error``) on a ``--layers`` below 1, or ``--layers``/``--routing`` that choose nothing."""
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    if args.model and args.model != DSV4_NAME and (args.layers is not None or args.routing is not None):
        parser.error("--layers and --routing choose a built-in model; a --model file has its own")
    if args.model == DSV4_NAME and args.routing is not None:
        parser.error(f"--routing is the built-in Qwen3 model's; --model {DSV4_NAME} has its own routers")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``aioexperts-bench --mode generate``."""
    p = OneLineParser(
        prog="aioexperts-bench --mode generate",
        description="Decode and prefill of aioexperts against llama.cpp (llama-cpp-python) on one whole model, "
        "each engine in its own process inside a memory cgroup, in interleaved rounds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--mode", choices=("generate",), default="generate", help=argparse.SUPPRESS)
    add_model_arguments(p)
    p.add_argument(
        "--limits", default="none,1/2,1/4", help="memory limits: none, or fractions in (0, 4] of the model file's size"
    )
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES), help=f"from {','.join(ENGINES)}")
    p.add_argument("--rounds", type=int, default=3, help="rounds per limit (engines interleaved in each)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt prefilled in one batch")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens evaluated one at a time per run")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--n-ctx", type=int, default=None, help="KV cache positions (default prompt + decode + 16)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds before one run is stopped")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids")
    p.add_argument(
        "--speculative",
        type=int,
        default=None,
        help="the aioexperts engines' MoE layers read speculatively beyond the prefetch depth "
        "(PrefetchOptions.speculative; default: the library's)",
    )
    p.add_argument(
        "--miss-tier",
        default=None,
        help="the low-precision miss tier's sidecar (aioexperts-tier writes it): adds the engine aioexperts-tier; "
        "None: that engine (if asked for in --engines) uses MODEL.miss-tier-TYPE.gguf (--miss-tier-type), written "
        "first if missing",
    )
    p.add_argument(
        "--miss-tier-type",
        default=None,
        choices=TIER_TYPES,
        help="without --miss-tier: the sidecar MODEL.miss-tier-TYPE.gguf beside the model (default Q3_K); "
        "adds the engine aioexperts-tier",
    )
    p.add_argument(
        "--miss-tier-weight", type=gate_weight, default=None, help="MissTier.max_gate_weight (None: no rule)"
    )
    p.add_argument("--miss-tier-behind", type=float, default=None, help="MissTier.behind_seconds (None: no rule)")
    p.add_argument(
        "--miss-tier-upgrade",
        action="store_true",
        help="MissTier(upgrade=True): low copies hit again are read again at full precision (off by default)",
    )
    p.add_argument(
        "--miss-tier-demand-only",
        action="store_true",
        help="MissTier(prefetches=False): the rules choose the tier of demand misses only, prefetches read full",
    )
    p.add_argument(
        "--no-warm-prefill",
        action="store_true",
        help="with no limit, measure the first (cold) prefill instead of warming every engine first",
    )
    p.add_argument(
        "--fio-gb", type=float, default=1.0, help="under a limit, GB of random experts fio reads per round (0: none)"
    )
    p.add_argument("--out", default="bench-generate.json", help="results file to write ('' for none)")
    p.add_argument("--force", action="store_true", help="let --out replace a file of another kind")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_version(p, "aioexperts-bench")
    return p


def usage_error(check: Callable[[], object]) -> int | None:
    """``check()`` (a test of the arguments, before or between the runs): None when it passes; its
    error (the library's, or an ``OSError``) as one line and the usage status when not."""
    try:
        check()
    except (AioExpertsError, OSError) as exc:
        print(f"aioexperts-bench: error: {error_text(exc)}", file=sys.stderr)
        return USAGE_STATUS
    return None


def model_file_error(args: argparse.Namespace) -> int | None:
    """A ``--model`` file that is missing, a directory, unreadable, or not a whole model (no
    vocabulary: these modes run the model on token ids): :func:`usage_error` (as every command says
    it, :func:`~aioexperts.cli._common.model_file`); None when the file is fine or a built-in model
    is asked for."""
    if not args.model or args.model == DSV4_NAME:
        return None

    def check() -> None:
        if "tokenizer.ggml.tokens" not in open_model(model_file(args.model)).metadata:
            raise ConfigError(
                f"{args.model} carries no tokenizer: this mode runs a whole model (aioexperts-bench "
                "--mode reads measures expert-only files)"
            )

    return usage_error(check)


def check_limits(limits: list[Fraction | None], model: str) -> None:
    """ConfigError for a memory limit below :data:`MIN_LIMIT_BYTES` (a fraction of a small model: no
    engine's process starts there, so every run would be "oom-killed")."""
    size = os.path.getsize(model)
    for limit in limits:
        if limit is not None and size * limit < MIN_LIMIT_BYTES:
            raise ConfigError(
                f"a limit of {limit} of this {size / 2**20:.1f} MiB model is {float(size * limit) / 2**20:.1f} MiB, "
                f"less than the {MIN_LIMIT_BYTES >> 20} MiB an engine's process needs to start (use a larger "
                "model, or --limits none)"
            )


def check_miss_tier_file(sidecar: str | None, model: str) -> None:
    """ConfigError for a ``--miss-tier`` sidecar that is not a regular file
    (:func:`~aioexperts.cli._common.sidecar_file_problem`) or not of ``model`` (stale, mismatched)."""
    if sidecar is None:
        return
    problem = sidecar_file_problem(sidecar)
    if problem is not None:
        raise ConfigError(problem)
    try:
        check_sidecar(os.path.expanduser(sidecar), model)
    except (AioExpertsError, OSError) as exc:
        raise ConfigError(f"--miss-tier {sidecar}: {error_text(exc)}") from exc


def _model(args: argparse.Namespace, note: Callable[[str], None]) -> str:
    if args.model and args.model != DSV4_NAME:
        return model_file(args.model)
    from ..testing import print_progress

    progress = None if args.quiet else print_progress()

    def on_wait() -> None:
        note("another run is writing the built-in model; waiting for it")

    try:
        return _write_builtin(args, note, progress, on_wait)
    except OSError as exc:
        raise cache_error(exc) from None


def _write_builtin(
    args: argparse.Namespace,
    note: Callable[[str], None],
    progress: Callable[[int, int], None] | None,
    on_wait: Callable[[], None],
) -> str:
    from ..testing import FULL_SPEC, SKEWED_SPEC, ensure_dsv4_model, ensure_full_model

    if args.model == DSV4_NAME:
        layers = args.layers or 4
        built = ensure_dsv4_model(
            layers,
            progress=progress,
            on_build=lambda p: note(
                f"writing the built-in DeepSeek-V4-geometry model ({plural(layers, 'layer')}) to {p} (once)"
            ),
            on_wait=on_wait,
        )
        return os.fspath(built)
    layers = args.layers or 48
    spec = (SKEWED_SPEC if args.routing == "skewed" else FULL_SPEC).with_(n_layer=layers)
    built = ensure_full_model(
        spec=spec,
        progress=progress,
        on_build=lambda p: note(f"writing the built-in full model ({plural(layers, 'layer')}) to {p} (once)"),
        on_wait=on_wait,
    )
    return os.fspath(built)


def _sidecar(model: str, ggml_type: str, note: Callable[[str], None]) -> str:
    """The model's miss-tier sidecar of ``ggml_type`` beside it, written first if it is not there (a
    stale one is refused by the engine's run: write it again with aioexperts-tier)."""
    path = default_output(model, ggml_type)
    if not os.path.exists(path):
        note(f"writing the miss tier {path} ({ggml_type}; minutes per GB of experts)")
        write_miss_tier(model, path, ggml_type)
    return path


def _is_ours(path: str) -> bool:
    from aioexperts_bench import load_generate_results

    try:
        load_generate_results(path)
    except (OSError, ValueError):
        return False
    return True


def _write(out: str, results: dict[str, object]) -> None:
    """Write ``results`` atomically (a partial file after each run, the whole one at the end)."""
    write_text(out, json_dumps(results, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point; 0 done, 1 the run failed, 2 bad arguments or a bad ``--model`` file (before any run)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        limits = [parse_limit(x) for x in args.limits.split(",") if x.strip()]
    except (ValueError, ZeroDivisionError) as exc:
        parser.error(f"--limits: {exc}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        parser.error(f"--engines: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(ENGINES)}")
    for name in ("rounds", "prompt_tokens", "decode_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_model_arguments(parser, args)
    needed = args.prompt_tokens + args.decode_tokens
    if args.n_ctx is not None and args.n_ctx < needed:
        parser.error(
            f"--n-ctx {args.n_ctx} is less than --prompt-tokens + --decode-tokens "
            f"({args.prompt_tokens} + {args.decode_tokens} = {needed})"
        )
    if not args.fio_gb >= 0:
        parser.error(f"--fio-gb must be >= 0, got {args.fio_gb}")
    if args.speculative is not None and args.speculative < 0:
        parser.error(f"--speculative must be >= 0, got {args.speculative}")
    if not args.run_timeout > 0:
        parser.error(f"--run-timeout must be > 0 seconds, got {args.run_timeout}")
    if not limits:
        parser.error("--limits needs at least one limit (none, 1/2, 1/4, ...)")
    if args.miss_tier is not None and args.miss_tier_type is not None:
        parser.error("--miss-tier-type chooses the sidecar beside the model; with --miss-tier give only the file")
    if len(set(limits)) != len(limits):
        parser.error("--limits: each limit once (use --rounds for more runs of one limit)")
    tier_rules = {
        "--miss-tier-weight": args.miss_tier_weight is not None,
        "--miss-tier-behind": args.miss_tier_behind is not None,
        "--miss-tier-upgrade": args.miss_tier_upgrade,
        "--miss-tier-demand-only": args.miss_tier_demand_only,
    }
    wants_tier = args.miss_tier is not None or args.miss_tier_type is not None or "aioexperts-tier" in engines
    for flag, given in tier_rules.items():
        if given and not wants_tier:
            parser.error(f"{flag} needs the aioexperts-tier engine (--miss-tier, --miss-tier-type or --engines)")
    if args.rounds > MAX_ROUNDS:
        parser.error(f"--rounds must be at most {MAX_ROUNDS}, got {args.rounds}")
    if (status := model_file_error(args)) is not None:
        return status
    if args.out and (status := usage_error(lambda: check_output_path(args.out, "--out"))) is not None:
        return status

    def note(text: str) -> None:
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (e.g. timeout(1)): remove the cgroup, keep the partial results

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        model = _model(args, note)

        def check_against_the_model() -> None:
            check_miss_tier_file(args.miss_tier, model)
            check_limits(limits, model)
            if args.out:
                refuse_to_overwrite(os.path.abspath(args.out), [model], ours=_is_ours, force=args.force, what="--out")

        if (status := usage_error(check_against_the_model)) is not None:
            return status
        miss_tier = None
        if wants_tier and "aioexperts-tier" not in engines:
            engines.insert(engines.index("aioexperts") + 1 if "aioexperts" in engines else 0, "aioexperts-tier")
        if "aioexperts-tier" in engines:
            miss_tier = {
                "path": os.path.abspath(args.miss_tier or _sidecar(model, args.miss_tier_type or "Q3_K", note)),
                "max_gate_weight": args.miss_tier_weight,
                "behind_seconds": args.miss_tier_behind,
                "upgrade": args.miss_tier_upgrade,
                "prefetches": not args.miss_tier_demand_only,
            }
        cfg = GenerateConfig(
            model=model,
            limits=limits,
            engines=engines,
            rounds=args.rounds,
            prompt_tokens=args.prompt_tokens,
            decode_tokens=args.decode_tokens,
            threads=args.threads,
            n_ctx=args.n_ctx or args.prompt_tokens + args.decode_tokens + 16,
            run_timeout=args.run_timeout,
            seed=args.seed,
            warm_prefill=not args.no_warm_prefill,
            fio_bytes=int(args.fio_gb * 1e9),
            miss_tier=miss_tier,
            speculative=args.speculative,
        )
        results = run_generate_bench(cfg, note=note, checkpoint=(lambda r: _write(args.out, r)) if args.out else None)
    except KeyboardInterrupt:
        done = (
            f"the runs done so far are in {args.out}"
            if args.out and os.path.exists(args.out)
            else "nothing was written"
        )
        print(f"aioexperts-bench: interrupted; {done}", file=sys.stderr)
        return 130
    except (AioExpertsError, OSError) as exc:
        print(f"aioexperts-bench: error: {error_text(exc)}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.out:
        _write(args.out, results)
    print(text_report(results))
    if args.out:
        print(
            f"results: {args.out} (`python bench/generate.py --render {args.out} -- README.md docs/bench.md` "
            "replaces those documents' headline with them)"
        )
    ours = [r for r in results["runs"] if r["engine"].startswith("aioexperts")]
    if ours and not any(r["status"] == "ok" for r in ours):
        print("aioexperts-bench: no aioexperts run completed (see the statuses above)", file=sys.stderr)
        return 1
    return 0
