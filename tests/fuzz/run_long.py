"""The fuzz harness's long run: N inputs across the four doors, a JSON summary (docs/fuzzing.md).

    nice -n 19 python tests/fuzz/run_long.py --inputs 1000000 --out docs/results/fuzz-DATE.json

The doors (tests/fuzz/fuzzkit.py) take turns, so a run stopped by ``--max-minutes`` or Ctrl-C still
has about as many inputs for each. Per door it counts the inputs, their outcomes, the unexpected
exception types (the first input of each is saved beside the summary), the hangs (an input taking
more than ``--time-limit`` seconds of CPU, or cut off by the wall-clock alarm at ``--hard-limit``:
CPU time, because the machine is shared) and the slowest input. An input that raises the process's
peak RSS by more than ``--rss-jump`` bytes counts as unexpected too. Every
``--memory-every``-th header input is a small file whose counts claim far more than it holds, read
under ``tracemalloc``: its peak must stay within ``64 * size + 256 KiB``. Warnings are errors, as
in the test suite. Single process, single thread.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import pickle
import platform
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's aioexperts, not an installed one

import fuzzkit as kit  # noqa: E402

import aioexperts  # noqa: E402
from aioexperts._format.header import read_header  # noqa: E402
from aioexperts._format.model import open_model  # noqa: E402

DOORS = ("header", "tokenizer", "chat", "serve")
MEMORY_FACTOR = 64
MEMORY_CONSTANT = 256 << 10


@dataclass
class DoorStats:
    inputs: int = 0
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    hangs: int = 0
    slowest_s: float = 0.0
    slowest_cpu_s: float = 0.0
    input_bytes: int = 0
    largest_input_bytes: int = 0
    rss_growth_bytes: int = 0  # the most one input raised the process's peak RSS
    examples: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "seconds": round(self.seconds, 2),
            "inputs_per_second": round(self.inputs / self.seconds, 1) if self.seconds else None,
            "unexpected": dict(self.unexpected),
            "unexpected_total": sum(self.unexpected.values()),
            "hangs": self.hangs,
            "slowest_input_s": round(self.slowest_s, 4),
            "slowest_input_cpu_s": round(self.slowest_cpu_s, 4),
            "mean_input_bytes": round(self.input_bytes / self.inputs, 1) if self.inputs else None,
            "largest_input_bytes": self.largest_input_bytes,
            "max_peak_rss_growth_per_input_bytes": self.rss_growth_bytes,
            "examples": self.examples,
            "outcomes": dict(self.outcomes.most_common(25)),
        }


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _size(value: Any) -> int:
    if isinstance(value, bytes | str):
        return len(value)
    try:
        return len(pickle.dumps(value))
    except (pickle.PicklingError, RecursionError, TypeError, ValueError):
        return 0


class Runner:
    def __init__(self, args: argparse.Namespace, work: str, examples_dir: Path) -> None:
        self.args = args
        self.work = work
        self.examples_dir = examples_dir
        self.rnd = random.Random(args.seed)
        self.stats = {d: DoorStats() for d in args.doors}
        self.memory = {
            "samples": 0,
            "violations": 0,
            "max_peak_bytes": 0,
            "max_peak_input_bytes": 0,
            "max_peak_over_input": 0.0,
            "max_ratio_over_constant": 0.0,
            "input_bytes_min": None,
            "input_bytes_max": 0,
        }
        self.memory_worst: dict[str, Any] = {}
        self.tokenizers = list(kit.load_tokenizers().items())
        self.templates = list(kit.load_templates().items())
        self._header_count = 0

    # -- inputs of each door: (input for the example file, the call) --------------------------------

    def _header(self) -> tuple[Any, Callable[[], str]]:
        self._header_count += 1
        if self.args.memory_every and self._header_count % self.args.memory_every == 0:
            data = kit.huge_count_input(self.rnd)
            return data, lambda: self._memory_sample(data)
        data = kit.header_input(self.rnd)
        return data, lambda: kit.header_door(data, self.work)

    def _memory_sample(self, data: bytes) -> str:
        path = os.path.join(self.work, "memory.gguf")
        with open(path, "wb") as f:
            f.write(data)
        tracemalloc.start()
        try:
            outcome = "ok"
            try:
                read_header(path)
                open_model(path)
            except kit.AioExpertsError as exc:
                outcome = type(exc).__name__
            except (kit.Hang, KeyboardInterrupt):
                raise
            except BaseException as exc:  # noqa: BLE001
                raise kit.Unexpected("header:memory", exc) from exc
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        m = self.memory
        m["samples"] += 1
        ratio = max(0, peak - MEMORY_CONSTANT) / max(1, len(data))
        if peak > m["max_peak_bytes"]:
            m["max_peak_bytes"], m["max_peak_input_bytes"] = peak, len(data)
        m["max_peak_over_input"] = max(m["max_peak_over_input"], round(peak / max(1, len(data)), 2))
        m["input_bytes_min"] = min(len(data), m["input_bytes_min"] or len(data))
        m["input_bytes_max"] = max(len(data), m["input_bytes_max"])
        if ratio > m["max_ratio_over_constant"]:
            m["max_ratio_over_constant"] = round(ratio, 3)
            self.memory_worst = {"input_bytes": len(data), "peak_bytes": peak}
        if peak > MEMORY_FACTOR * len(data) + MEMORY_CONSTANT:
            m["violations"] += 1
            raise kit.Unexpected("header:memory", MemoryError(f"peak {peak} B for a {len(data)}-byte input"))
        return f"memory:{outcome}"

    def _tokenizer(self) -> tuple[Any, Callable[[], str]]:
        name, tok = self.tokenizers[self.rnd.randrange(len(self.tokenizers))]
        r = self.rnd.random()
        text: Any
        if r < 0.9:
            text = kit.random_text(self.rnd)
        elif r < 0.97:
            raw = self.rnd.randbytes(self.rnd.randrange(64))
            text = raw.decode("utf-8", "surrogateescape") if self.rnd.random() < 0.5 else raw
        else:
            text = kit._pick(self.rnd, (None, 1, ["a"], b"", "", 1.5))
        ids = kit.random_ids(self.rnd, tok.n_vocab)
        flags = self.rnd.randrange(8)
        return (name, text, ids, flags), lambda: kit.tokenizer_door(tok, text, ids, flags)

    def _chat(self) -> tuple[Any, Callable[[], str]]:
        name, template = self.templates[self.rnd.randrange(len(self.templates))]
        messages = kit.random_messages(self.rnd)
        tools = None if self.rnd.random() < 0.8 else kit.random_json(self.rnd)
        gen = self.rnd.random() < 0.5
        return (name, messages, tools, gen), lambda: kit.chat_door(template, messages, tools, gen)

    def _serve(self) -> tuple[Any, Callable[[], str]]:
        if self.rnd.random() < 0.2:
            value = kit.random_json(self.rnd) if self.rnd.random() < 0.5 else kit.random_body(self.rnd)
            return value, lambda: kit.serve_value_door(value)
        raw = kit.encode_body(self.rnd, kit.random_body(self.rnd))
        return raw, lambda: kit.serve_door(raw)

    # -- the loop -------------------------------------------------------------------------------------

    def one(self, door: str) -> None:
        value, call = getattr(self, f"_{door}")()
        st = self.stats[door]
        st.inputs += 1
        size = _size(value) if door != "header" else len(value)
        st.input_bytes += size
        st.largest_input_bytes = max(st.largest_input_bytes, size)
        rss0 = _peak_rss()
        signal.setitimer(signal.ITIMER_REAL, self.args.hard_limit)
        t0 = time.perf_counter()
        c0 = time.thread_time()
        try:
            st.outcomes[call()] += 1
        except kit.Unexpected as exc:
            key = f"{exc.door}: {type(exc.cause).__name__}"
            st.unexpected[key] += 1
            if key not in st.examples:
                st.examples[key] = self._save(door, key, value, exc)
        except kit.Hang:
            st.outcomes["hang (alarm)"] += 1
            st.hangs += 1
            st.examples[f"alarm-{st.hangs}"] = self._save(door, "alarm", value, None)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        dt = time.perf_counter() - t0
        cpu = time.thread_time() - c0
        growth = _peak_rss() - rss0
        if growth > st.rss_growth_bytes:
            st.rss_growth_bytes = growth
            if growth > self.args.rss_jump:
                st.unexpected["memory: peak RSS jump"] += 1
                st.examples[f"rss-jump-{growth}"] = self._save(door, "rss-jump", value, None)
        st.seconds += dt
        st.slowest_s = max(st.slowest_s, dt)
        st.slowest_cpu_s = max(st.slowest_cpu_s, cpu)
        if cpu > self.args.time_limit:
            st.hangs += 1
            key = f"hang-{st.hangs}"
            if st.hangs <= 3:
                st.examples[key] = self._save(door, key, value, None)

    def _save(self, door: str, key: str, value: Any, exc: BaseException | None) -> str:
        name = f"{door}-{len(os.listdir(self.examples_dir)) + 1}.json"
        try:
            blob = base64.b64encode(pickle.dumps(value)).decode()
        except (pickle.PicklingError, RecursionError, TypeError, ValueError):
            blob = None
        text = repr(value)
        record = {
            "door": door,
            "key": key,
            "error": None if exc is None else str(exc)[:2000],
            "repr": text[:20000],
            "repr_truncated": len(text) > 20000,
            "pickle_base64": blob,
        }
        (self.examples_dir / name).write_text(json.dumps(record, indent=1))
        return name

    def run(self) -> dict[str, Any]:
        args = self.args
        per_door = args.inputs // len(args.doors)
        deadline = time.monotonic() + args.max_minutes * 60 if args.max_minutes else None
        started = time.time()
        t0 = time.monotonic()
        last = t0
        stopped = "done"
        try:
            for i in itertools.count():
                if all(self.stats[d].inputs >= per_door for d in args.doors):
                    break
                door = args.doors[i % len(args.doors)]
                if self.stats[door].inputs >= per_door:
                    continue
                self.one(door)
                now = time.monotonic()
                if now - last >= args.progress:
                    last = now
                    done = sum(s.inputs for s in self.stats.values())
                    bad = sum(sum(s.unexpected.values()) for s in self.stats.values())
                    hangs = sum(s.hangs for s in self.stats.values())
                    rate = done / (now - t0)
                    line = f"[{now - t0:7.0f} s] {done} inputs ({rate:.0f}/s), {bad} unexpected, {hangs} hangs"
                    print(line, file=sys.stderr, flush=True)
                    if args.out:
                        self._write(self._summary(started, now - t0, "running"))
                if deadline is not None and now > deadline:
                    stopped = "max-minutes"
                    break
        except KeyboardInterrupt:
            stopped = "interrupted"
        return self._summary(started, time.monotonic() - t0, stopped)

    def _summary(self, started: float, elapsed: float, stopped: str) -> dict[str, Any]:
        total = sum(s.inputs for s in self.stats.values())
        return {
            "what": "aioexperts fuzz harness, long run (tests/fuzz/run_long.py; docs/fuzzing.md)",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "elapsed_s": round(elapsed, 1),
            "stopped": stopped,
            "args": vars(self.args),
            "aioexperts": {"version": aioexperts.__version__, "file": aioexperts.__file__},
            "machine": {
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "nice": os.nice(0),
            },
            "inputs": total,
            "inputs_per_second": round(total / elapsed, 1) if elapsed else None,
            "unexpected_total": sum(sum(s.unexpected.values()) for s in self.stats.values()),
            "hangs_total": sum(s.hangs for s in self.stats.values()),
            "peak_rss_bytes": _peak_rss(),
            "header_memory": {
                **self.memory,
                "bound": f"tracemalloc peak <= {MEMORY_FACTOR} * input bytes + {MEMORY_CONSTANT} B",
                "worst": self.memory_worst,
            },
            "tokenizers": [name for name, _ in self.tokenizers],
            "templates": [name for name, _ in self.templates],
            "doors": {d: s.summary() for d, s in self.stats.items()},
        }

    def _write(self, summary: dict[str, Any]) -> None:
        out = Path(self.args.out)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=1_000_000, help="inputs in total, split evenly over the doors")
    p.add_argument("--doors", default=",".join(DOORS), help=f"comma-separated, of {','.join(DOORS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=1.0, help="an input taking more CPU is a hang (s)")
    p.add_argument("--hard-limit", type=float, default=60.0, help="an alarm stops an input after this (wall, s)")
    p.add_argument("--memory-every", type=int, default=20, help="every Nth header input is a memory sample")
    p.add_argument("--rss-jump", type=int, default=256 << 20, help="one input raising peak RSS this much fails")
    p.add_argument("--max-minutes", type=float, default=0, help="stop after this long (0: no limit)")
    p.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines")
    p.add_argument("--out", default=None, help="the JSON summary (also rewritten at each progress line)")
    p.add_argument(
        "--examples", default=None, help="folder for the first input of each failure (default: OUT.examples)"
    )
    args = p.parse_args(argv)
    args.doors = [d.strip() for d in args.doors.split(",") if d.strip()]
    for d in args.doors:
        if d not in DOORS:
            p.error(f"unknown door {d!r}")

    def alarm(signum: int, frame: Any) -> None:
        raise kit.Hang()

    signal.signal(signal.SIGALRM, alarm)
    warnings.simplefilter("error")  # as in the test suite (pyproject's filterwarnings)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    examples = Path(
        args.examples or (f"{args.out}.examples" if args.out else tempfile.mkdtemp(prefix="fuzz-examples-"))
    )
    examples.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="aioexperts-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        runner = Runner(args, work, examples)
        summary = runner.run()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["examples_dir"] = str(examples)
    if args.out:
        runner._write(summary)
    if not any(examples.iterdir()):
        examples.rmdir()
    print(json.dumps({k: summary[k] for k in ("inputs", "inputs_per_second", "unexpected_total", "hangs_total")}))
    for d, s in summary["doors"].items():
        print(
            f"{d:10s} {s['inputs']:8d} inputs, {s['unexpected_total']} unexpected, {s['hangs']} hangs, "
            f"slowest {s['slowest_input_s']} s  {s['unexpected']}"
        )
    return 1 if summary["unexpected_total"] or summary["hangs_total"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
