"""``aioexperts-serve``: an OpenAI-compatible HTTP server for a GGUF MoE model (default: the built-in full model).

Binds ``127.0.0.1:8080`` unless told otherwise and prints ``listening on http://HOST:PORT`` on stderr
once it serves (``--port 0`` takes a free port: that line says which). SIGTERM or Ctrl-C (SIGINT)
stops it gracefully: no new requests, the running generations finish for up to
``--shutdown-timeout`` seconds and are then cancelled, the model is closed; exit status 0. A second
signal cancels the running generations at once (each told ``shutting_down``), then closes the model;
exit status 1. Bad arguments, files or models: one line on stderr naming the option, exit status 2.
The endpoints are described in docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

import anyio

import aioexperts
from aioexperts.cli._common import (
    USAGE_STATUS,
    HelpFormatter,
    OneLineParser,
    add_version,
    builtin_full_model,
    error_text,
    model_file,
    name_the_options,
    plural,
)
from aioexperts.cli.run import (
    _context_length,
    _float,
    _int_at_least,
    add_model_options,
    check_miss_tier,
    miss_tier_option,
    say_slab,
)

__all__ = ("build_parser", "main")

PROG = "aioexperts-serve"


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``aioexperts-serve``."""

    p = OneLineParser(
        prog=PROG,
        description=(
            "Serve a Mixture-of-Experts GGUF model over an OpenAI-compatible HTTP API (chat and text "
            "completions, streaming, tokenize, metrics). Without MODEL it serves the built-in full model "
            "(random weights: its text is random), written once to the user cache."
        ),
        formatter_class=HelpFormatter,
    )
    add_version(p, PROG)
    p.add_argument("model", nargs="?", help="a GGUF file (or a shard of a split set); default: the built-in model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=_port, default=8080, help="TCP port; 0 takes a free one")
    p.add_argument("--parallel", type=_int_at_least(1), default=4, help="sequences that decode at once")
    p.add_argument("--queue", type=_int_at_least(0), default=16, help="requests that may wait for a slot (FIFO)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: no key)")
    p.add_argument(
        "--max-body-bytes", type=_int_at_least(1), default=1 << 20, help="larger request bodies are refused (413)"
    )
    p.add_argument(
        "--body-timeout",
        type=_float,
        default=30.0,
        help="seconds a request body may take to arrive; slower ones get 408 and their connection closed",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=_float,
        default=30.0,
        help="seconds running generations may take to finish after SIGTERM before they are cancelled",
    )
    p.add_argument("--alias", default=None, help="the model's id in /v1/models and responses (default: file name)")
    p.add_argument(
        "--prompt-cache-bytes",
        type=_int_at_least(0),
        default=None,
        help="KV cache bytes finished sequences may keep for later requests' common prefixes; 0 turns the "
        "prompt cache off (default: half the memory left after the model and --parallel sequences, "
        "at most 16 sequences)",
    )
    p.add_argument(
        "--reasoning-format",
        choices=aioexperts.REASONING_FORMATS,
        default="auto",
        help="<think> text: returned apart as reasoning_content (auto, deepseek) or left in the content (none)",
    )
    add_model_options(p, ctx_help="positions of each sequence's KV cache (n_ctx; default 4096")
    return p


#: The option of each field of :class:`aioexperts.serve.ServerOptions` (its errors name the option).
SERVER_FLAGS = {
    "host": "--host",
    "port": "--port",
    "parallel": "--parallel",
    "queue_size": "--queue",
    "api_key": "--api-key",
    "max_body_bytes": "--max-body-bytes",
    "body_timeout": "--body-timeout",
    "shutdown_timeout": "--shutdown-timeout",
    "model_name": "--alias",
    "prompt_cache_bytes": "--prompt-cache-bytes",
    "reasoning_format": "--reasoning-format",
}


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _model_path(args: argparse.Namespace) -> str:
    if args.model is not None:
        return model_file(args.model)
    built = builtin_full_model(args.layers, args.rebuild, _say)
    _say("the built-in model's weights are random, so its text is random")
    return built


async def _serve(args: argparse.Namespace, path: str, options: Any) -> int:
    from aioexperts.serve import Server

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    task = asyncio.current_task()
    assert task is not None
    serving: list[Server] = []  # the server once it is built
    hurried = False

    def on_signal(signum: int) -> None:
        nonlocal hurried
        if stop.is_set():  # the second signal: stop at once
            if serving and not hurried:  # the running generations are cancelled now, told why; the model
                hurried = True  # is closed after them (never under them: no "store is closed")
                _say(f"{signal.Signals(signum).name} again: cancelling the running requests now")
                serving[0].hurry()
            else:  # before the server is up, or a third signal
                task.cancel()
            return
        _say(f"{signal.Signals(signum).name}: stopping (running requests get {args.shutdown_timeout:g} s to finish)")
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        n_ctx = await anyio.to_thread.run_sync(_context_length, path, args.ctx)
        model = aioexperts.load(
            path,
            n_ctx=n_ctx,
            slots=args.slots,
            cache_bytes=args.cache_bytes,
            io=aioexperts.IOOptions(backend=args.io),
            miss_tier=miss_tier_option(args),
        )
        async with model:
            if stop.is_set():  # a signal during the load: never open the port
                _say("stopped before serving")
                return 0
            say_slab(args, model, _say)
            server = Server(model, options)
            serving.append(server)
            if stop.is_set():
                server.hurry()
            await server.start()
            try:
                _say(f"serving {path} (n_ctx {model.n_ctx}, --parallel {options.parallel})")
                _say(f"listening on {server.url}")
                await stop.wait()
            finally:
                with anyio.CancelScope(shield=True):
                    cancelled = await server.stop()
            if cancelled:
                when = "at the second signal" if hurried else "at the deadline"
                _say(f"cancelled {plural(cancelled, 'generation')} still running {when}")
        _say("stopped at once (second signal)" if hurried else "stopped")
        return 1 if hurried else 0
    except asyncio.CancelledError:
        _say("stopped at once (second signal)")
        task.uncancel()
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def _check_host(host: str, port: int = 0) -> None:
    """``--host`` resolves to an address to bind and ``--port`` is free there, before the model loads
    (ConfigError naming the option). The port is bound once and released (``SO_REUSEADDR``, as the
    server binds it), so a port another process holds is said in seconds, not after the load."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        why = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)  # no "[Errno -2]"
        raise aioexperts.ConfigError(f"--host {host!r}: not an address or host name to bind ({why})") from None
    if port == 0:
        return
    for family, kind, proto, _name, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                why = f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})"
                raise aioexperts.ConfigError(why) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``aioexperts-serve``; returns the exit status (0 stopped by a signal, 1 stopped at once by a
    second signal, 2 bad arguments/files/models)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is not None and (args.layers is not None or args.rebuild):
        parser.error("--layers and --rebuild are for the built-in model (no MODEL argument)")
    check_miss_tier(parser, args)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s", stream=sys.stderr)
    logging.getLogger("aioexperts.slab").setLevel(logging.ERROR)  # say_slab says it, naming the option
    try:
        from aioexperts.serve import ServerOptions

        try:
            options = ServerOptions(
                host=args.host,
                port=args.port,
                parallel=args.parallel,
                queue_size=args.queue,
                api_key=args.api_key,
                max_body_bytes=args.max_body_bytes,
                body_timeout=args.body_timeout,
                shutdown_timeout=args.shutdown_timeout,
                model_name=args.alias,
                prompt_cache_bytes=args.prompt_cache_bytes,
                reasoning_format=args.reasoning_format,
            )
        except aioexperts.ConfigError as exc:
            raise aioexperts.ConfigError(name_the_options(str(exc), SERVER_FLAGS)) from None
        _check_host(args.host, args.port)
        path = _model_path(args)
    except KeyboardInterrupt:
        return 130
    except (aioexperts.AioExpertsError, OSError) as exc:
        _say(f"error: {error_text(exc)}")
        return USAGE_STATUS
    try:
        return asyncio.run(_serve(args, path, options))
    except (aioexperts.AioExpertsError, OSError) as exc:
        _say(f"error: {error_text(exc)}")
        return USAGE_STATUS


if __name__ == "__main__":
    sys.exit(main())
