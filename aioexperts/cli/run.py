"""``aioexperts-run``: generate text with a GGUF MoE model (default: the built-in full model), then its statistics.

Text goes to stdout as it is decoded; progress, notes and the statistics (prompt and generation
tokens per second, time to first token, expert hit rate, bytes read per token, memory) go to
stderr. With ``--json`` nothing is printed on stdout until the end, then one JSON object (the text
included). Ctrl-C (SIGINT) cancels the generation, still prints the statistics and exits with 130;
a second Ctrl-C stops at once. When the reader of stdout goes (``| head``) the generation stops,
the statistics still go to stderr (``stop: output_closed``) and the exit status is 141. Bad
arguments or files: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import logging
import os
import resource
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TextIO

import anyio

import aioexperts
from aioexperts._json import dumps as strict_dumps
from aioexperts.cli._common import (
    BROKEN_PIPE_STATUS,
    INTERRUPTED_STATUS,
    USAGE_STATUS,
    HelpFormatter,
    OneLineParser,
    add_version,
    builtin_full_model,
    error_text,
    gate_weight,
    model_file,
    name_the_options,
    plural,
    sidecar_file_problem,
    slab_note,
    stdout_closed,
)

__all__ = ("INTERRUPTED_STATUS", "build_parser", "for_terminal", "main")

PROG = "aioexperts-run"

#: Exit status for bad arguments, files and models.

#: The stop reason of a turn whose text could not be written: the reader of stdout has gone
#: (``aioexperts-run ... | head``). The command then exits with ``BROKEN_PIPE_STATUS`` (141).
OUTPUT_CLOSED = "output_closed"

#: n_ctx when ``--ctx`` is not given (llama.cpp's default), capped to the file's context length.
DEFAULT_CTX = 4096

#: ``-f``: a prompt of more UTF-8 bytes than this many per position of n_ctx (``--ctx``, else
#: :data:`DEFAULT_CTX`, the most the run can have) is refused before it is read or tokenized: no
#: vocabulary's tokens average this many bytes on text, so it cannot fit, and the bound keeps a
#: huge file (or ``-f /dev/zero``) out of memory.
MAX_PROMPT_BYTES_PER_POSITION = 64


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``aioexperts-run``."""

    p = OneLineParser(
        prog=PROG,
        description=(
            "Generate text with a Mixture-of-Experts GGUF model whose experts stream from SSD. Without MODEL it "
            "runs the built-in full model (Qwen3-30B-A3B-shaped, random weights: its text is random), written once "
            "to the user cache."
        ),
        formatter_class=HelpFormatter,
    )
    add_version(p, PROG)
    p.add_argument("model", nargs="?", help="a GGUF file (or a shard of a split set); default: the built-in model")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="the prompt text (with --chat: the first user message)")
    src.add_argument(
        "-f",
        "--file",
        help=f"read the prompt from this UTF-8 file (- for stdin; at most {MAX_PROMPT_BYTES_PER_POSITION} bytes "
        "per position of n_ctx)",
    )
    p.add_argument("-n", "--n-predict", type=_int_at_least(1), default=128, help="tokens to generate at most")
    p.add_argument("--chat", action="store_true", help="chat through the model's template; reads turns from stdin")
    p.add_argument("--system", help="a system message (with --chat)")
    p.add_argument("--temp", type=_float, default=0.8, help="temperature; 0 is greedy")
    p.add_argument("--top-k", type=_int_at_least(0), default=40, help="top-k sampling; 0 is off")
    p.add_argument("--top-p", type=_float, default=0.95, help="top-p (nucleus) sampling; 1 is off")
    p.add_argument("--min-p", type=_float, default=0.05, help="min-p sampling; 0 is off")
    p.add_argument("--repeat-penalty", type=_float, default=1.0, help="repetition penalty; 1 is off")
    p.add_argument("--presence-penalty", type=_float, default=0.0, help="presence penalty; 0 is off")
    p.add_argument("--frequency-penalty", type=_float, default=0.0, help="frequency penalty; 0 is off")
    p.add_argument(
        "--penalty-last-n", type=_int_at_least(-1), default=64, help="tokens the penalties look back at; -1 all"
    )
    p.add_argument("--seed", type=_int_at_least(0), default=None, help="seed of the sampler (default: a fresh one)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeat for more); not printed")
    add_model_options(p, ctx_help=f"positions of the KV cache (n_ctx; default {DEFAULT_CTX}")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of text as it comes")
    return p


def check_miss_tier(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The ``--miss-tier`` options of :func:`add_model_options`, checked before the model loads (a
    usage error, status 2): ``--miss-tier-weight`` needs ``--miss-tier``, whose file must exist and be
    a regular file (the sidecar itself is checked against the model when the model loads)."""
    if args.miss_tier is None:
        if args.miss_tier_weight is not None:
            parser.error("--miss-tier-weight needs --miss-tier")
        return
    problem = sidecar_file_problem(args.miss_tier)
    if problem is not None:
        parser.error(problem)


def miss_tier_option(args: argparse.Namespace) -> aioexperts.MissTier | None:
    """The :class:`aioexperts.MissTier` of the ``--miss-tier`` options, or None."""
    if not args.miss_tier:
        return None
    return aioexperts.MissTier(path=args.miss_tier, max_gate_weight=args.miss_tier_weight)


def add_model_options(p: argparse.ArgumentParser, *, ctx_help: str) -> None:
    """The options of the model a command loads: ``--ctx``, ``--slots``/``--cache-bytes``, ``--io``,
    ``--layers`` and ``--rebuild`` (``aioexperts-run`` and ``aioexperts-serve``)."""
    from aioexperts.testing import DEFAULT_FULL_LAYERS

    p.add_argument(
        "--ctx",
        type=_int_at_least(1),
        default=None,
        help=f"{ctx_help}, or the file's context length if smaller)",
    )
    slab = p.add_mutually_exclusive_group()
    slab.add_argument("--slots", type=_int_at_least(1), default=None, help="slab slots, one expert each")
    slab.add_argument(
        "--cache-bytes",
        type=_int_at_least(1),
        default=None,
        help="slab size in bytes (default: sized from the memory limit the process runs under)",
    )
    p.add_argument(
        "--io",
        choices=("auto", "io_uring", "threads"),
        default="auto",
        help="expert reads: io_uring where it works (auto), or the preadv thread pool",
    )
    p.add_argument(
        "--miss-tier",
        default=None,
        help="a low-precision miss tier sidecar (aioexperts-tier): misses read smaller experts (opt-in)",
    )
    p.add_argument(
        "--miss-tier-weight",
        type=gate_weight,
        default=None,
        help="with --miss-tier: only misses whose gate weight (their routing weight: 0..1 when a token's "
        "weights sum to 1, up to the model's expert_weights_scale when it scales them) is below this go low; "
        "a value above every weight (1 for most models) sends every demand miss low but keeps prefetches "
        "without a predicted weight full (default: every read low, prefetches too)",
    )
    p.add_argument(
        "--layers",
        type=_int_at_least(1),
        default=None,
        help=f"layers of the built-in model (default {DEFAULT_FULL_LAYERS}; 48 is the real depth)",
    )
    p.add_argument("--rebuild", action="store_true", help="write the built-in model again")


# -- what is reported --------------------------------------------------------------------------------


@dataclass
class _Turn:
    user: str | None
    text: str = ""
    error: str | None = None  # a chat turn that was skipped (it did not fit n_ctx): why
    stats: aioexperts.GenerationStatistics = field(default_factory=aioexperts.GenerationStatistics)


@dataclass
class _Report:
    model: str
    builtin: bool
    turns: list[_Turn] = field(default_factory=list)
    load_seconds: float | None = None
    n_ctx: int | None = None
    model_stats: aioexperts.ModelStatistics | None = None
    store_stats: aioexperts.StoreStatistics | None = None
    rss_bytes: int | None = None
    interrupted: bool = False
    error: str | None = None
    at_prompt: bool = False  # the "> " prompt is shown, waiting for a line

    def totals(self) -> dict[str, Any]:
        s = [t.stats for t in self.turns]
        prompt = sum(x.prefilled_tokens for x in s)
        generated = sum(x.generated_tokens for x in s)
        prefill = sum(x.prefill_seconds for x in s)
        decode = sum(x.decode_seconds for x in s)
        decoded = sum(max(0, x.generated_tokens - 1) for x in s)
        ttft = [x.time_to_first_token for x in s if x.time_to_first_token is not None]
        return {  # the names of GenerationStatistics, summed over the turns
            "prompt_tokens": sum(x.prompt_tokens for x in s),
            "reused_tokens": sum(x.reused_tokens for x in s),
            "prefilled_tokens": prompt,
            "generated_tokens": generated,
            "prefill_seconds": prefill,
            "decode_seconds": decode,
            "prompt_tokens_per_second": prompt / prefill if prefill > 0 and prompt else None,
            "decode_tokens_per_second": decoded / decode if decode > 0 and decoded else None,
            "time_to_first_token": ttft[0] if ttft else None,
            "stop_reason": s[-1].stop_reason if s else None,
            "stop_string": s[-1].stop_string if s else None,
        }

    def experts(self) -> dict[str, Any] | None:
        st, ms = self.store_stats, self.model_stats
        if st is None or ms is None:
            return None
        run = ms.tokens_prefilled + ms.tokens_decoded
        return {
            "hit_rate": st.hit_rate if st.requests else None,  # 0 of 0 is no rate
            "requests": st.requests,
            "hits": st.hits,
            "inflight_joins": st.inflight_joins,
            "misses": st.misses,
            "bytes_read": st.bytes_read,
            "prefetch_issued": st.prefetch_issued,
            "prefetch_wasted": st.prefetch_wasted,
            "tokens_run": run,
            "bytes_read_per_token": st.bytes_read / run if run else None,
            "cached_hits": st.cached_hits,
            "prefetched_in_time": st.prefetched_in_time,
            "prefetched_late": st.prefetched_late,
            "demand_misses": st.demand_misses,
            "low_tier_misses": st.low_tier_misses,
            "tier_upgrades": st.tier_upgrades,
            "low_tier_prefetches": st.low_tier_prefetches,
            "low_tier_prefetch_hits": st.low_tier_prefetch_hits,
            "tier_upgrades_deferred": st.tier_upgrades_deferred,
            "miss_tier_off_reason": st.miss_tier_off_reason,
            "stall_seconds": ms.stall_seconds,
            "stall_seconds_per_token": ms.stall_seconds_per_token,
            "device_busy_seconds": st.device_busy_seconds,
            "device_bytes_per_second": st.device_rate,
            "backend": st.backend,
            "direct_io": st.direct_io,
        }

    def memory(self) -> dict[str, Any]:
        st, ms = self.store_stats, self.model_stats
        return {
            "rss_bytes": self.rss_bytes,
            "peak_rss_bytes": _peak_rss_bytes(self.rss_bytes),
            "slab_bytes": st.n_slots * st.slot_bytes if st else None,
            "slab_slots": st.n_slots if st else None,
            "resident_weight_bytes": ms.dense_bytes if ms else None,
            "kv_cache_bytes": ms.n_ctx * ms.kv_bytes_per_position if ms else None,
        }

    def as_json(self, chat: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "builtin_model": self.builtin,
            "n_ctx": self.n_ctx,
            "load_seconds": self.load_seconds,
            "interrupted": self.interrupted,
            "error": self.error,
        }
        if chat:
            out["turns"] = [
                {
                    "user": t.user,
                    "assistant": t.text,
                    "error": t.error,
                    **asdict(t.stats),
                    "prompt_tokens_per_second": t.stats.prompt_tokens_per_second,
                    "decode_tokens_per_second": t.stats.decode_tokens_per_second,
                }
                for t in self.turns
            ]
        else:
            out["text"] = self.turns[0].text if self.turns else ""
        out.update(self.totals())
        out["experts"] = self.experts()
        out["memory"] = self.memory()
        return out

    def print_human(self, out: TextIO) -> None:
        t = self.totals()

        def rate(v: float | None) -> str:
            return f"{v:.2f} tok/s" if v is not None else "n/a"

        ttft = t["time_to_first_token"]
        reused = f", {t['reused_tokens']} reused from the KV cache" if t["reused_tokens"] else ""
        later = max(0, t["generated_tokens"] - 1)
        stop = t["stop_reason"] or "n/a"
        if t["stop_string"] is not None:
            stop += f" (at {t['stop_string']!r})"
        lines = [
            f"prompt: {plural(t['prefilled_tokens'], 'token')} prefilled in {t['prefill_seconds']:.3f} s "
            f"({rate(t['prompt_tokens_per_second'])}){reused}; time to first token "
            + (f"{ttft:.3f} s" if ttft is not None else "n/a"),
            f"generation: {plural(t['generated_tokens'], 'token')}; decode {rate(t['decode_tokens_per_second'])} "
            f"({plural(later, 'token')} after the first in {t['decode_seconds']:.3f} s); stop: {stop}",
        ]
        ex = self.experts()
        if ex is not None:
            per = ex["bytes_read_per_token"]
            lines.append(
                "experts: hit rate "
                + (f"{ex['hit_rate']:.1%}" if ex["hit_rate"] is not None else "n/a")
                + f" ({plural(ex['hits'], 'hit')}, {ex['inflight_joins']} joined a read under way, "
                f"{plural(ex['misses'], 'miss', 'misses')} of {plural(ex['requests'], 'request')}); "
                f"read {_size(ex['bytes_read'])}, "
                + (f"{_size(per)} per token" if per is not None else "n/a per token")
                + f" ({plural(ex['tokens_run'], 'token')} run); "
                f"{plural(ex['prefetch_issued'], 'prefetch', 'prefetches')} started "
                f"({ex['prefetch_wasted']} evicted unused); {ex['backend']}{', O_DIRECT' if ex['direct_io'] else ''}"
            )
            lines.append(_sources_line(ex))
        m = self.memory()
        parts = [f"RSS {_size(m['rss_bytes'])} (peak {_size(m['peak_rss_bytes'])})"]
        if m["slab_bytes"] is not None:
            parts.append(f"slab {_size(m['slab_bytes'])} ({plural(m['slab_slots'], 'slot')})")
        if m["resident_weight_bytes"] is not None:
            parts.append(f"resident weights {_size(m['resident_weight_bytes'])}")
        if m["kv_cache_bytes"] is not None:
            parts.append(f"KV cache {_size(m['kv_cache_bytes'])} (n_ctx {self.n_ctx})")
        lines.append("memory: " + ", ".join(parts))
        if self.load_seconds is not None:
            lines.append(f"load: {self.load_seconds:.2f} s")
        if self.interrupted:
            lines.append("interrupted (Ctrl-C)")
        for line in lines:
            print(line, file=out)


def _sources_line(ex: dict[str, Any]) -> str:
    """Where the experts came from and where the pass waited (issue 36's statistics), one line."""
    stall = ex["stall_seconds_per_token"]
    rate = ex["device_bytes_per_second"]
    low = (
        f", {ex['low_tier_misses']} of them from the low tier ({plural(ex['tier_upgrades'], 'upgrade')} started); "
        f"{ex['low_tier_prefetch_hits']} prefetched from the low tier, "
        f"{plural(ex['tier_upgrades_deferred'], 'upgrade')} put off while the reads were behind"
        if ex["low_tier_misses"] or ex["low_tier_prefetch_hits"]
        else ""
    )
    if ex.get("miss_tier_off_reason"):
        low += f" (miss tier off: {ex['miss_tier_off_reason']})"
    return (
        f"expert sources: {ex['cached_hits']} cached, {ex['prefetched_in_time']} prefetched in time, "
        f"{ex['prefetched_late']} prefetched late, {plural(ex['demand_misses'], 'demand miss', 'demand misses')}"
        f"{low}; stalled on reads "
        + (f"{stall * 1e3:.1f} ms per token" if stall is not None else "n/a per token")
        + f" ({ex['stall_seconds']:.3f} s); device "
        + (f"{_size(int(rate))}/s while reading" if rate is not None else "idle")
    )


def _size(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _peak_rss_bytes(current: int | None) -> int | None:
    """The high-water RSS (``VmHWM``), never below ``current``: ``ru_maxrss`` is updated lazily by
    the kernel and can read lower than the RSS just measured."""
    peak: int | None = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(peak, current) if current is not None else peak


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# -- running ---------------------------------------------------------------------------------------


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


#: The option of each field of :class:`aioexperts.SamplingOptions` (its errors name the option).
SAMPLING_FLAGS = {
    "temperature": "--temp",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repeat_penalty": "--repeat-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "penalty_last_n": "--penalty-last-n",
    "seed": "--seed",
    "max_tokens": "-n",
    "stop": "--stop",
}


def _options(args: argparse.Namespace) -> aioexperts.SamplingOptions:
    """The sampling options (ConfigError naming the option out of range: ``--temp``, not ``temperature``)."""
    try:
        return _sampling_options(args)
    except aioexperts.ConfigError as exc:
        raise aioexperts.ConfigError(name_the_options(str(exc), SAMPLING_FLAGS)) from None


def _sampling_options(args: argparse.Namespace) -> aioexperts.SamplingOptions:
    return aioexperts.SamplingOptions(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        penalty_last_n=args.penalty_last_n,
        seed=args.seed,
        max_tokens=args.n_predict,
        stop=tuple(args.stop),
    )


#: C0 controls (but tab and newline), DEL and C1 controls: shown escaped on a terminal, where an
#: escape sequence in generated text could move the cursor, retitle the window or clear the screen.
_TERMINAL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)}


def for_terminal(text: str) -> str:
    """``text`` with its control characters (but tab and newline) written as ``\\xNN`` escapes."""
    return text.translate(_TERMINAL_ESCAPES)


async def _emit(stream: Any, turn: _Turn, args: argparse.Namespace) -> None:
    """Write the pieces of ``stream`` to stdout as they come (not with ``--json``), then a newline.

    Raises:
        BrokenPipeError: the reader of stdout has gone; the turn's ``stop_reason`` is then
            :data:`OUTPUT_CLOSED` (the stream, still open, stops when the caller leaves it).
    """
    to_terminal = sys.stdout.isatty()
    closed = False
    try:
        async for piece in stream:
            turn.text += piece
            if not args.json:
                sys.stdout.write(for_terminal(piece) if to_terminal else piece)
                sys.stdout.flush()
    except BrokenPipeError:
        closed = True
        raise
    finally:
        turn.stats = stream.statistics
        if closed:
            turn.stats = replace(turn.stats, stop_reason=OUTPUT_CLOSED)
        elif not args.json and turn.text:
            sys.stdout.write("\n")
            sys.stdout.flush()


class _Lines:
    """The lines of stdin, read by a daemon thread of their own.

    A wait for a line that never comes (Ctrl-C at an idle ``> `` prompt on a terminal) must not keep
    the process alive: a worker thread of the event loop would be joined at exit, so the process
    would wait for Enter (and a second Ctrl-C would interrupt that join with a traceback). The file
    descriptor is read directly, so the thread never holds the lock of ``sys.stdin`` at exit.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._thread: threading.Thread | None = None

    def _put(self, line: str | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, line)

    def _read(self) -> None:
        try:
            fd = sys.stdin.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (replaced in-process): its own readline
            for line in iter(sys.stdin.readline, ""):
                self._put(line)
            self._put(None)
            return
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        while True:
            try:
                data = os.read(fd, 65536)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            pending += decoder.decode(data, final=not data)
            *lines, pending = pending.split("\n")
            for line in lines:
                self._put(line + "\n")
            if not data:
                if pending:
                    self._put(pending)
                self._put(None)
                return

    async def next(self) -> str | None:
        """The next line (with its newline), None at EOF; a cancelled wait leaves the thread reading."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._read, name="aioexperts-run-stdin", daemon=True)
            self._thread.start()
        return await self._queue.get()


async def _generate(model: aioexperts.Model, args: argparse.Namespace, prompt: str | None, report: _Report) -> None:
    options = _options(args)
    if not args.chat:
        assert prompt is not None
        turn = _Turn(None)
        stream = model.stream(prompt, options=options)  # bad prompts raise here, before a turn is counted
        report.turns.append(turn)
        async with stream:
            await _emit(stream, turn, args)
        return
    lines = _Lines()
    async with model.chat(args.system, options=options) as session:
        first = prompt
        while True:
            if first is not None:
                user, first = first, None
            else:
                if not args.json:
                    print("> ", end="", file=sys.stderr, flush=True)
                    report.at_prompt = True
                line = await lines.next()
                report.at_prompt = False
                if line is None:
                    if not args.json:
                        print(file=sys.stderr, flush=True)  # Ctrl-D: what follows starts a line of its own
                    return
                user = line.rstrip("\n")
                if not user.strip():
                    continue
            turn = _Turn(user)
            try:
                stream = session.send(user)
            except aioexperts.ContextLengthError:  # this turn only: the conversation so far is kept
                turn.error = _turn_too_long(model, session.messages, user, args)
                report.turns.append(turn)
                _say(f"error: {turn.error}")
                continue
            report.turns.append(turn)
            async with stream:
                await _emit(stream, turn, args)
            s = turn.stats
            if not args.json:
                print(
                    f"[{plural(s.reused_tokens, 'prompt token')} reused, {s.prefilled_tokens} prefilled; "
                    f"{s.generated_tokens} generated; stop: {s.stop_reason}]",
                    file=sys.stderr,
                    flush=True,
                )


def _turn_too_long(model: aioexperts.Model, messages: list[dict[str, Any]], user: str, args: argparse.Namespace) -> str:
    """What to say when a chat turn makes the conversation longer than n_ctx (the turn is skipped)."""
    ids = model.apply_chat_template([*messages, {"role": "user", "content": user}], tokenize=True)
    return (
        f"with this message the conversation is {plural(len(ids), 'token')}, more than n_ctx={model.n_ctx} "
        f"positions{_ctx_given(args)}: the message is skipped and the chat goes on (send a shorter one, or start again "
        "with a larger --ctx)"
    )


def _ctx_given(args: argparse.Namespace) -> str:
    return f" (--ctx {args.ctx})" if args.ctx is not None else " (the default; --ctx sets it)"


def say_slab(args: argparse.Namespace, model: aioexperts.Model, say: Any = None) -> None:
    """One stderr line when the slab is not the size ``--slots`` / ``--cache-bytes`` asked for."""
    st = model.store.statistics()
    note = slab_note(args.slots, args.cache_bytes, st.n_slots, st.slot_bytes)
    if note is not None:
        (say or _say)(note)


def _context_length(path: str, requested: int | None) -> int:
    """``--ctx``, else :data:`DEFAULT_CTX` capped to the file's ``{arch}.context_length`` (FormatError: a bad file)."""
    if requested is not None:
        return requested
    gguf = aioexperts.open_model(path)
    trained = gguf.key("context_length")
    if isinstance(trained, int) and not isinstance(trained, bool) and trained > 0:
        return min(DEFAULT_CTX, trained)
    return DEFAULT_CTX


def _check_prompt(model: aioexperts.Model, args: argparse.Namespace, prompt: str | None, n_ctx: int) -> None:
    """Before the weights load (a worker thread; the model is not started): the tokenizer and, with
    ``--chat``, the chat template are built from the file's metadata, and a prompt of more tokens than
    ``n_ctx`` is refused, with the ids the first turn would run (``Model.stream``'s tokenization, or
    the chat template's rendering of ``--system`` and the prompt).

    Raises:
        ContextLengthError: the prompt does not fit ``n_ctx``.
        VocabularyError, OptionalDependencyError, ChatTemplateError, TokenizerError: from the
            tokenizer or the chat template.
    """
    tokenizer = model.tokenizer
    if args.chat:
        model.chat_template  # noqa: B018 (a missing or broken template is a usage error, before any turn)
    if prompt is None:
        if args.chat and args.system:  # the first turn comes from stdin: the system message alone must fit
            ids = model.apply_chat_template(
                [{"role": "system", "content": args.system}, {"role": "user", "content": "x"}], tokenize=True
            )
            if len(ids) > n_ctx:
                raise aioexperts.ContextLengthError(
                    f"--system takes {plural(len(ids), 'token')} in the chat template (with a one-letter message), "
                    f"more than n_ctx={n_ctx} positions{_ctx_given(args)}: no turn fits (give a larger --ctx, or a "
                    "shorter --system); the model was not loaded"
                )
        return
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        ids = model.apply_chat_template([*system, {"role": "user", "content": prompt}], tokenize=True)
    else:
        ids = tokenizer.encode(prompt, add_special=True, parse_special=False)  # as Model.stream
    if len(ids) >= n_ctx:
        than = "more than" if len(ids) > n_ctx else "all of"
        raise aioexperts.ContextLengthError(
            f"the prompt is {plural(len(ids), 'token')}, {than} n_ctx={n_ctx} positions{_ctx_given(args)}, with "
            "none left for a generated token: it is not truncated "
            "(give a larger --ctx, or a shorter prompt); the model was not loaded"
        )


async def _session(args: argparse.Namespace, path: str, prompt: str | None, report: _Report) -> None:
    t0 = time.perf_counter()
    n_ctx = await anyio.to_thread.run_sync(_context_length, path, args.ctx)
    model = aioexperts.load(
        path,
        n_ctx=n_ctx,
        slots=args.slots,
        cache_bytes=args.cache_bytes,
        io=aioexperts.IOOptions(backend=args.io),
        miss_tier=miss_tier_option(args),
    )
    await anyio.to_thread.run_sync(_check_prompt, model, args, prompt, n_ctx)  # off the event loop
    async with model:
        try:
            report.load_seconds = time.perf_counter() - t0
            report.n_ctx = model.n_ctx
            say_slab(args, model)
            _say(f"loaded {path} in {report.load_seconds:.2f} s (n_ctx {model.n_ctx})")
            await _generate(model, args, prompt, report)
        finally:
            report.model_stats = model.statistics()
            report.store_stats = model.store.statistics()
            report.rss_bytes = _rss_bytes()


async def _run(args: argparse.Namespace, path: str, prompt: str | None, report: _Report) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_sigint() -> None:
        report.interrupted = True
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C raises KeyboardInterrupt at once
        task.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    status = 0
    try:
        await _session(args, path, prompt, report)
    except BrokenPipeError:  # `aioexperts-run ... | head`: the reader has what it wanted
        stdout_closed()
        status = BROKEN_PIPE_STATUS
    except asyncio.CancelledError:
        if not report.interrupted:
            raise
        task.uncancel()
    except (aioexperts.AioExpertsError, OSError) as exc:
        report.error = error_text(exc)
        _say(f"error: {error_text(exc)}")
        status = USAGE_STATUS if not report.turns else 1
    finally:
        if not report.interrupted:
            loop.remove_signal_handler(signal.SIGINT)
    status = _with_interrupt(report, status)
    if status == INTERRUPTED_STATUS and report.at_prompt:  # the statistics start a line of their own
        print(file=sys.stderr, flush=True)
    return status


def _with_interrupt(report: _Report, status: int) -> int:
    """``status``, or 130 when the report says Ctrl-C came, however the session ended (an async
    exit on the way out may absorb the cancellation; the chat may end on stdin's end of file and the
    signal be handled as the loop shuts down), unless the reader of stdout has gone (141)."""
    return INTERRUPTED_STATUS if report.interrupted and status != BROKEN_PIPE_STATUS else status


def _read_prompt(args: argparse.Namespace) -> str | None:
    """``-p``, or the text of ``-f`` (a regular file, or ``-`` for stdin), universal newlines as a text file.

    At most :data:`MAX_PROMPT_BYTES_PER_POSITION` bytes per position of n_ctx are read: a larger
    file is refused from its size, unread.

    Raises:
        ConfigError: the file cannot be read, is not a regular file or is not UTF-8 (naming it).
        ContextLengthError: the prompt has more bytes than n_ctx positions can hold.
    """
    if args.file is None:
        prompt: str | None = args.prompt
        return prompt
    n_ctx = args.ctx if args.ctx is not None else DEFAULT_CTX
    limit = MAX_PROMPT_BYTES_PER_POSITION * n_ctx

    def too_long(size: int, more: str = "") -> aioexperts.ContextLengthError:
        return aioexperts.ContextLengthError(
            f"-f {args.file}: the prompt is {more}{plural(size, 'byte')}, more than n_ctx={n_ctx} positions"
            f"{_ctx_given(args)} can hold at {MAX_PROMPT_BYTES_PER_POSITION} bytes a token: it is not truncated "
            "(give a larger --ctx, or a shorter prompt); it was not read"
        )

    try:
        if args.file == "-":
            if sys.stdin is None:
                raise aioexperts.ConfigError("-f -: standard input is closed")
            data = sys.stdin.buffer.read(limit + 1)
        else:
            # O_NONBLOCK: opening a FIFO does not wait for a writer (the file is refused below)
            fd = os.open(os.path.expanduser(args.file), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    raise aioexperts.ConfigError(f"-f {args.file}: is a directory, not a prompt file")
                if not stat.S_ISREG(st.st_mode):
                    raise aioexperts.ConfigError(
                        f"-f {args.file}: not a regular file (a device, a FIFO): give a file, or -f - for stdin"
                    )
                if st.st_size > limit:
                    raise too_long(st.st_size)
                with open(fd, "rb", closefd=False) as f:
                    data = f.read(limit + 1)  # the file may have grown since the fstat
            finally:
                os.close(fd)
        if len(data) > limit:
            raise too_long(limit, "more than ")
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise aioexperts.ConfigError(
            f"-f {args.file}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    except OSError as exc:
        raise aioexperts.ConfigError(f"-f {args.file}: {exc.strerror or exc}") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as open(..., encoding="utf-8").read()


def _model_path(args: argparse.Namespace) -> tuple[str, bool]:
    if args.model is not None:
        return model_file(args.model), False
    return builtin_full_model(args.layers, args.rebuild, _say), True


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``aioexperts-run``; returns the exit status (0 done, 1 failed while generating, 2 bad
    arguments/files/models, 130 interrupted, 141 the reader of stdout has gone)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt is None and args.file is None and not args.chat:
        parser.error("give a prompt with -p TEXT or -f FILE, or chat with --chat")
    if args.model is not None and (args.layers is not None or args.rebuild):
        parser.error("--layers and --rebuild are for the built-in model (no MODEL argument)")
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    if args.file == "-" and args.chat:
        parser.error("-f - reads the prompt from stdin, where --chat reads the turns: give -p or a file")
    check_miss_tier(parser, args)
    if sys.stdout is None or sys.stderr is None:  # started with >&- or 2>&-: nowhere to write the text
        if sys.stderr is not None:
            print(f"{PROG}: error: standard output is closed", file=sys.stderr)
        return USAGE_STATUS
    if args.chat and sys.stdin is None:
        parser.error("--chat reads the turns from standard input, which is closed")
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s", stream=sys.stderr)
    logging.getLogger("aioexperts.slab").setLevel(logging.ERROR)  # say_slab says it, naming the option
    try:
        _options(args)  # sampling options out of range: a usage error before anything is loaded
        prompt = _read_prompt(args)
        if prompt is not None and not prompt:
            raise aioexperts.InvalidRequestError("the prompt is empty")
        path, builtin = _model_path(args)
    except KeyboardInterrupt:
        _say("interrupted")
        return INTERRUPTED_STATUS
    except (aioexperts.AioExpertsError, OSError, UnicodeDecodeError) as exc:
        _say(f"error: {error_text(exc)}")
        return USAGE_STATUS
    if builtin:  # a note on stderr, as the progress lines: --json changes stdout only
        _say("the built-in model's weights are random, so its text is random")
    report = _Report(path, builtin)
    try:
        status = asyncio.run(_run(args, path, prompt, report))
    except KeyboardInterrupt:
        return INTERRUPTED_STATUS
    status = _with_interrupt(report, status)  # again: the signal may be handled after _run returned
    if status == USAGE_STATUS and not args.json:
        return status  # the one error line says it all
    try:
        if args.json:
            print(strict_dumps(report.as_json(args.chat), indent=2))
        else:
            report.print_human(sys.stderr)
        sys.stdout.flush()
    except BrokenPipeError:
        return stdout_closed()
    return status


if __name__ == "__main__":
    sys.exit(main())
