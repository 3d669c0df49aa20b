"""``aioexperts-tier``: write a model's low-precision miss tier (a sidecar GGUF; issue 36).

``aioexperts-tier MODEL [-o SIDECAR] [--type Q3_K|Q2_K|IQ4_XS] [--force]`` re-quantizes every routed
expert of ``MODEL`` to the smaller type with ggml's reference quantizers (our own, byte for byte
llama.cpp's) and writes them, keyed to the model's files, beside it (default
``MODEL.miss-tier-TYPE.gguf``). Use it with ``aioexperts.load(MODEL, miss_tier=MissTier(path=SIDECAR))``
or ``aioexperts-run --miss-tier SIDECAR``; a sidecar of another model, or of an older version of
this one, is refused. It never writes over the model, and replaces an existing file only if it is a
miss-tier sidecar, or with ``--force`` (never over any shard of a split model). Progress goes to
stderr; errors are one line with status 2; Ctrl-C removes the partial file and exits 130 after one
line (``aioexperts-tier: interrupted``), SIGTERM likewise with 143 (``terminated``); a closed stdout
exits 141 with nothing printed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .. import AioExpertsError, open_model, write_miss_tier
from ..testing import progress_bytes
from ._common import (
    INTERRUPTED_STATUS,
    USAGE_STATUS,
    HelpFormatter,
    OneLineParser,
    add_version,
    error_text,
    model_file,
    refuse_to_overwrite,
    stdout_closed,
)

__all__ = ("main",)

#: What ``--help`` says (plain text: argparse prints it as it is).
DESCRIPTION = (
    "Write a model's low-precision miss tier: every routed expert of MODEL re-quantized to a smaller type "
    "(Q3_K by default) with llama.cpp's reference quantizers, into a sidecar GGUF beside the model "
    "(MODEL.miss-tier-TYPE.gguf). Use it with aioexperts-run --miss-tier SIDECAR (or aioexperts-serve "
    "--miss-tier SIDECAR): expert misses then read the smaller copy. A sidecar of another model, or of an "
    "older version of this one, is refused when it is used. The model is never written over; an existing "
    "file is replaced only if it is a miss-tier sidecar, or with --force. Progress goes to stderr, the "
    "sidecar's path to stdout; an error is one line on stderr with exit status 2."
)

TYPES = ("Q3_K", "Q2_K", "IQ4_XS")
TIER_ARCH = "aioexperts-miss-tier"


def default_output(model: str, ggml_type: str) -> str:
    """``MODEL.miss-tier-TYPE.gguf`` beside the model (its ``.gguf`` suffix dropped)."""
    stem = model[: -len(".gguf")] if model.endswith(".gguf") else model
    return f"{stem}.miss-tier-{ggml_type}.gguf"


def _is_sidecar(path: str) -> bool:
    try:
        return open_model(path).architecture == TIER_ARCH
    except (AioExpertsError, OSError):
        return False


class _Terminated(BaseException):
    """SIGTERM arrived (raised by the handler :func:`_sigterm_raises` installs)."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the sidecar is written, SIGTERM raises :class:`_Terminated` in the main thread, so the
    writer removes its temporary file as it does for Ctrl-C (the default action killed the process
    and left a file of the sidecar's size behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; 0 on success, 2 on an error (one line on stderr), 130 interrupted (Ctrl-C),
    143 terminated (SIGTERM), 141 when stdout's reader has gone."""
    parser = OneLineParser(prog="aioexperts-tier", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("model", help="the model (a GGUF file or any shard of a split set)")
    parser.add_argument("-o", "--out", default=None, help="the sidecar to write (default MODEL.miss-tier-TYPE.gguf)")
    parser.add_argument("--type", default="Q3_K", choices=TYPES, help="the low ggml type")
    parser.add_argument("--force", action="store_true", help="replace an existing file that is not a sidecar")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    add_version(parser, "aioexperts-tier")
    args = parser.parse_args(argv)
    try:
        model = model_file(args.model)
    except AioExpertsError as exc:
        print(f"aioexperts-tier: error: {exc}", file=sys.stderr)
        return USAGE_STATUS
    out = default_output(model, args.type) if args.out is None else os.path.expanduser(args.out)
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if not args.quiet and (now - last[0] >= 2.0 or done == total):
            last[0] = now
            left = (now - t0) * (total - done) / done if done else None
            if left is None or done == total:
                eta = ""
            elif left < 90:  # "about 0 min left" at half way of a short run said nothing
                eta = f", about {left:.0f} s left"
            else:
                eta = f", about {left / 60:.0f} min left"
            print(
                f"aioexperts-tier: {progress_bytes(done, total)} written ({100 * done / total:.0f} %{eta})",
                file=sys.stderr,
                flush=True,
            )

    try:
        with _sigterm_raises():
            shards = [s.path for s in open_model(model).shards]  # every file of a split set is the model
            refuse_to_overwrite(out, shards, ours=_is_sidecar, force=args.force, what="the sidecar")
            t0 = time.monotonic()
            path = write_miss_tier(model, out, args.type, progress=progress)
    except (AioExpertsError, OSError) as exc:
        print(f"aioexperts-tier: error: {error_text(exc)}", file=sys.stderr)
        return USAGE_STATUS
    except KeyboardInterrupt:  # write_miss_tier has removed its temporary file
        print("aioexperts-tier: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    except _Terminated:  # as for Ctrl-C
        print("aioexperts-tier: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    if not args.quiet:
        size = os.path.getsize(path)
        print(
            f"aioexperts-tier: wrote {path} ({size / 1e6:.1f} MB, {args.type}) in {time.monotonic() - t0:.1f} s",
            file=sys.stderr,
        )
    try:
        print(path, flush=True)
    except BrokenPipeError:  # `aioexperts-tier ... | true`: the sidecar is written, the reader has gone
        return stdout_closed()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
