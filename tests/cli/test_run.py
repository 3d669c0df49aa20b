"""``aioexperts-run``: text on stdout, the statistics, ``--json``, ``--chat``, Ctrl-C, bad arguments.

Each case runs the command in a subprocess on the small built-in full model of tests/conftest.py
(``--io threads``: the thread-pool backend works everywhere the tests run).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aioexperts._compute.jit import cache_dir
from aioexperts.testing._full_model import FULL_SPEC

COMMAND = [sys.executable, "-m", "aioexperts.cli.run"]
STATS = ("tok/s", "time to first token", "hit rate", "per token", "RSS", "slab", "resident weights", "KV cache")


def run(
    *args: str, stdin: str = "", env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_streams_text_to_stdout_and_the_statistics_to_stderr(tiny_full_model: Path) -> None:
    done = run(str(tiny_full_model), "-p", "Once upon a time", "-n", "12", "--temp", "0", "--io", "threads")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    for needle in STATS:
        assert needle in done.stderr
    assert "prompt: " in done.stderr and "generation: 12 tokens" in done.stderr or "stop: eog" in done.stderr
    assert "Traceback" not in done.stderr
    # every expert request is a hit, a join of a read under way or a miss: the line adds up
    counts = re.search(
        r"\((\d+) hits?, (\d+) joined a read under way, (\d+) miss(?:es)? of (\d+) requests?\)", done.stderr
    )
    assert counts is not None, done.stderr
    hits, joins, misses, requests = (int(g) for g in counts.groups())
    assert hits + joins + misses == requests > 0
    # and every request has one source (issue 36): the four sources add up to the same requests
    sources = re.search(
        r"expert sources: (\d+) cached, (\d+) prefetched in time, (\d+) prefetched late, (\d+) demand miss(?:es)?; "
        r"stalled on reads [\d.]+ ms per token",
        done.stderr,
    )
    assert sources is not None, done.stderr
    assert sum(int(g) for g in sources.groups()) == requests
    # prefetches are counted as started, of them the evicted unused; the used ones are sources above
    started = re.search(r"(\d+) prefetch(?:es)? started \((\d+) evicted unused\)", done.stderr)
    assert started is not None, done.stderr
    assert int(started.group(2)) <= int(started.group(1))


def test_json_is_one_parseable_object_with_the_same_text(tiny_full_model: Path) -> None:
    args = (str(tiny_full_model), "-p", "Once upon a time", "-n", "10", "--temp", "0.9", "--seed", "5")
    args = (*args, "--io", "threads")
    as_json = run(*args, "--json")
    as_text = run(*args)
    assert as_json.returncode == 0 == as_text.returncode, as_json.stderr + as_text.stderr
    report = json.loads(as_json.stdout)  # the whole of stdout
    assert report["text"] and report["text"] + "\n" == as_text.stdout  # same seed, same text; nothing interleaved
    assert report["generated_tokens"] >= 1 and report["prompt_tokens"] >= 1
    assert report["stop_reason"] in ("length", "eog") and report["stop_string"] is None
    assert report["time_to_first_token"] > 0 and report["interrupted"] is False
    ex = report["experts"]
    assert 0 <= ex["hit_rate"] <= 1 and ex["bytes_read_per_token"] > 0
    sources = ("cached_hits", "prefetched_in_time", "prefetched_late", "demand_misses")
    assert sum(ex[k] for k in sources) == ex["requests"] and ex["demand_misses"] > 0
    assert 0 <= ex["stall_seconds_per_token"] and ex["device_bytes_per_second"] > 0
    memory = report["memory"]
    assert memory["rss_bytes"] > 0 and memory["slab_bytes"] > 0 and memory["resident_weight_bytes"] > 0
    # layers * (K, V) * KV heads * head size * float16 (the default KV type)
    assert memory["kv_cache_bytes"] == report["n_ctx"] * 2 * 2 * 2 * 64 * 2
    assert report["n_ctx"] == 512  # the file's context length, under the default 4096
    assert memory["peak_rss_bytes"] >= memory["rss_bytes"]


def test_json_totals_and_turns_use_the_same_field_names(tiny_full_model: Path) -> None:
    done = run(
        *(str(tiny_full_model), "--chat", "-n", "4", "--temp", "0", "--io", "threads", "--json"),
        stdin="Hello\nAgain\n",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    turn_keys = set(report["turns"][0]) - {"user", "assistant", "stop_string"}
    assert turn_keys <= set(report), sorted(turn_keys - set(report))
    assert report["generated_tokens"] == sum(t["generated_tokens"] for t in report["turns"])
    assert report["decode_seconds"] == pytest.approx(sum(t["decode_seconds"] for t in report["turns"]))


def test_control_characters_are_escaped_for_a_terminal_only() -> None:
    from aioexperts.cli.run import for_terminal

    assert for_terminal("a\x1b[2Jb\tc\nd\x07\x7f\x9b") == "a\\x1b[2Jb\tc\nd\\x07\\x7f\\x9b"
    assert for_terminal("plain text, ümlaut") == "plain text, ümlaut"


def test_penalty_options_reach_the_sampler() -> None:
    from aioexperts.cli.run import _options, build_parser

    args = build_parser().parse_args(["-p", "x", "--repeat-penalty", "1.3", "--presence-penalty", "0.5"])
    opts = _options(args)
    assert (opts.repeat_penalty, opts.presence_penalty, opts.frequency_penalty) == (1.3, 0.5, 0.0)
    bad = run("-p", "x", "--repeat-penalty", "0")
    assert bad.returncode == 2 and "--repeat-penalty 0.0 is outside" in bad.stderr and "Traceback" not in bad.stderr


def test_chat_reads_turns_from_stdin_and_reuses_the_kv_cache(tiny_full_model: Path) -> None:
    done = run(
        *(str(tiny_full_model), "--chat", "--system", "Be brief.", "-n", "5", "--temp", "0"),
        *("--io", "threads", "--json"),
        stdin="Hello\nHow are you?\n",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    turns = report["turns"]
    assert [t["user"] for t in turns] == ["Hello", "How are you?"]
    assert turns[0]["reused_tokens"] == 0 and turns[1]["reused_tokens"] > turns[0]["prompt_tokens"] // 2
    assert turns[1]["prefilled_tokens"] == turns[1]["prompt_tokens"] - turns[1]["reused_tokens"]


def test_sigint_stops_the_generation_prints_the_statistics_and_exits_130(tiny_full_model: Path) -> None:
    proc = subprocess.Popen(
        # greedy: on this model it runs to n_ctx (about 500 tokens) without an end-of-generation id
        [*COMMAND, str(tiny_full_model), "-p", "Tell me everything.", "-n", "100000", "--temp", "0", "--io", "threads"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        first = b""
        while not first and time.monotonic() < deadline:  # wait for the first streamed text
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                first = os.read(proc.stdout.fileno(), 1024)
                if not first:
                    break  # EOF: the process ended before any text
        assert first, "no text arrived"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.decode()
    assert proc.returncode == 130, stderr
    assert "interrupted (Ctrl-C)" in stderr and "stop: cancelled" in stderr
    for needle in STATS:
        assert needle in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_a_reader_of_stdout_that_goes_stops_the_generation_and_exits_141(tiny_full_model: Path, chat: bool) -> None:
    """``aioexperts-run ... | head -c 5``: no traceback, ``stop: output_closed``, exit 141 (as the other tools)."""
    args = [str(tiny_full_model), "-p", "Tell me everything.", "-n", "100000", "--temp", "0", "--io", "threads"]
    proc = subprocess.Popen(
        # greedy: on this model it runs to n_ctx (about 500 tokens), long after the reader has gone
        [*COMMAND, *args, *(["--chat"] if chat else [])],
        stdin=subprocess.DEVNULL,  # --chat: EOF after the first turn
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        deadline = time.monotonic() + 120
        first = b""
        while len(first) < 5 and time.monotonic() < deadline:  # as head -c 5: read 5 bytes, then go
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 5 - len(first))
                if not chunk:
                    break  # EOF: the process ended before 5 bytes
                first += chunk
        assert len(first) == 5, first
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    stderr = err.decode()
    assert proc.returncode == 141, stderr
    assert "stop: output_closed" in stderr and "Traceback" not in stderr and "Exception ignored" not in stderr
    generated = re.search(r"generation: (\d+) tokens?", stderr)
    assert generated is not None and int(generated.group(1)) < 400, stderr  # it stopped, not ran to n_ctx


def test_a_complete_model_named_like_a_shard_runs(tiny_full_model: Path, tmp_path: Path) -> None:
    """``cp tiny.gguf tiny-00001-of-00002.gguf``: no split.count in it, so one file, as llama.cpp opens it."""
    model = tmp_path / "tiny-00001-of-00002.gguf"
    shutil.copyfile(tiny_full_model, model)
    done = run(str(model), "-p", "hi", "-n", "2", "--temp", "0", "--io", "threads")
    assert done.returncode == 0, done.stderr
    assert f"loaded {model} in" in done.stderr and "missing" not in done.stderr


def test_without_a_model_it_runs_the_built_in_model_from_the_cache(tiny_full_model: Path, tmp_path: Path) -> None:
    """No MODEL argument: the built-in model's cache file is used (here a small one put in its place)."""
    shutil.copy(tiny_full_model, tmp_path / FULL_SPEC.with_(n_layer=2).file_name())
    (tmp_path / "numba").symlink_to(cache_dir().parent)  # the compiled kernels of this session, not a recompile
    env = {**os.environ, "AIOEXPERTS_CACHE": str(tmp_path)}
    done = run("--layers", "2", "-p", "Hello", "-n", "4", "--temp", "0", "--io", "threads", env=env)
    assert done.returncode == 0, done.stderr
    assert "random" in done.stderr and "writing" not in done.stderr
    assert done.stdout.strip()
    assert sorted(p.name for p in tmp_path.glob("*.gguf*")) == [FULL_SPEC.with_(n_layer=2).file_name()]
    # --json changes stdout only: the notes (and the progress lines of a build) still go to stderr
    done = run("--layers", "2", "-p", "Hello", "-n", "2", "--io", "threads", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["builtin_model"] is True
    assert "random" in done.stderr and "loaded " in done.stderr, done.stderr


def test_json_still_prints_the_progress_of_writing_the_built_in_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process, with the built-in model's spec made tiny: the build's lines go to stderr with --json."""
    from conftest import TINY_FULL_SPEC_FIELDS

    from aioexperts.cli.run import main
    from aioexperts.testing import _builtin as full_model
    from aioexperts.testing._full_model import FullModelSpec

    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path))
    (tmp_path / "numba").symlink_to(cache_dir().parent)
    monkeypatch.setattr(full_model, "FULL_SPEC", FullModelSpec(**TINY_FULL_SPEC_FIELDS))  # type: ignore[arg-type]
    assert main(["--layers", "2", "-p", "Hi", "-n", "1", "--io", "threads", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["builtin_model"] is True
    assert "writing the built-in full model (2 layers)" in err and "  written " in err, err
    assert "random" in err and "loaded " in err, err


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_a_prompt_longer_than_ctx_is_refused_before_the_model_loads(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], chat: bool
) -> None:
    """The prompt is tokenized with the file's tokenizer (and, with --chat, rendered with its template and
    --system) before the weights load: a prompt longer than --ctx is refused without a load."""
    import aioexperts
    from aioexperts.cli.run import main

    started: list[bool] = []

    async def no_start(self: aioexperts.Model) -> None:
        started.append(True)
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(aioexperts.Model, "start", no_start)
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    tokens = len(aioexperts.Tokenizer.from_gguf(tiny_full_model).encode(prompt))
    argv = [str(tiny_full_model), "-p", prompt, "--ctx", "16", "--io", "threads"]
    if chat:
        argv += ["--chat", "--system", "Be terse."]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert started == [] and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "more than n_ctx=16 positions (--ctx 16)" in lines[0] and "the model was not loaded" in lines[0]
    counted = int(re.search(r"the prompt is (\d+) tokens", lines[0]).group(1))  # type: ignore[union-attr]
    assert counted > tokens if chat else counted == tokens  # the chat turn adds the template's tokens


def test_a_slab_other_than_asked_for_is_said_on_stderr(tiny_full_model: Path) -> None:
    """--cache-bytes 10 is raised to the store's minimum (one token's experts twice over), --slots
    past the model's experts is capped: a line says so, also with --json."""
    for size, needle in (
        (["--cache-bytes", "10"], "--cache-bytes 10 raised to the store's minimum: the slab has"),
        (["--slots", "100000"], "--slots 100000: the slab has"),
    ):
        done = run(str(tiny_full_model), "-p", "Hi", "-n", "1", "--io", "threads", "--json", *size)
        assert done.returncode == 0, done.stderr
        assert needle in done.stderr and done.stderr.count("the slab has") == 1, done.stderr
    done = run(str(tiny_full_model), "-p", "Hi", "-n", "1", "--io", "threads", "--slots", "2")
    assert "the slab has" not in done.stderr, done.stderr
    assert "generation: 1 token; " in done.stderr and "(0 tokens after the first in" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["MODEL"], "give a prompt"),
        (["MODEL", "-p", "x", "-f", "y"], "not allowed with"),
        (["MODEL", "-p", "x", "--temp", "hot"], "--temp: must be a number"),
        (["MODEL", "-p", "x", "-n", "0"], "must be >= 1"),
        (["MODEL", "-p", "x", "--top-p", "3"], "--top-p 3.0 is outside (0.0, 1.0]"),
        (["MODEL", "-p", "x", "--temp", "-1"], "--temp -1.0 is outside [0.0, float32's largest (3.4e38)]"),
        (["MODEL", "-p", "x", "--temp", "1e39"], "--temp 1e+39 is outside [0.0, float32's largest (3.4e38)]"),
        (["MODEL", "-p", "x", "--temp", "inf"], "--temp must be a finite number, got inf"),
        (["MODEL", "-p", "x", "--min-p", "nan"], "--min-p must be a finite number"),
        (["MODEL", "-p", "x", "--stop", ""], "--stop must hold non-empty strings"),
        (["MODEL", "-f", "NOT_UTF8"], "-f NOT_UTF8: not UTF-8 text (byte 0xff at offset 3)"),
        (["MODEL", "-p", "x", "--layers", "2"], "built-in model"),
        (["MODEL", "-p", ""], "prompt is empty"),
        (["MODEL", "-f", "/no/such/prompt.txt"], "-f /no/such/prompt.txt: No such file or directory"),
        (["/no/such/model.gguf", "-p", "x"], "no such model file"),
        (["/tmp", "-p", "x"], "/tmp: is a directory, not a model file"),
        (["MODEL", "-p", "x", "--miss-tier", "/no/such/tier.gguf"], "--miss-tier /no/such/tier.gguf: no such file"),
        (["MODEL", "-p", "x", "--miss-tier-weight", "0.5"], "--miss-tier-weight needs --miss-tier"),
        (["MODEL", "-p", "x", "--miss-tier", "MODEL", "--miss-tier-weight", "-1"], "argument --miss-tier-weight: must"),
        (["MODEL", "-p", "x", "--miss-tier", "MODEL", "--miss-tier-weight", "nan"], "finite number >= 0"),
        (["NOT_GGUF", "-p", "x"], "not a GGUF file"),
        (["MODEL", "-p", "x", "--ctx", "4"], "more than n_ctx=4"),
        # issue 31: a KV cache beyond the memory limit was a numpy MemoryError traceback and exit 1
        (["MODEL", "-p", "x", "--ctx", "99999999"], "n_ctx=99999999 needs 102399998976 bytes"),  # F16 K, V
    ],
)
def test_bad_arguments_and_files_exit_2_with_one_line(
    tiny_full_model: Path, tmp_path: Path, args: list[str], needle: str
) -> None:
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_text("hello")
    not_utf8 = tmp_path / "latin1.txt"
    not_utf8.write_bytes(b"caf\xff")
    paths = {"MODEL": str(tiny_full_model), "NOT_GGUF": str(not_gguf), "NOT_UTF8": str(not_utf8)}
    argv = [paths.get(a, a) for a in args]
    needle = needle.replace("NOT_UTF8", str(not_utf8))
    if "--ctx" in argv:
        argv[argv.index("-p") + 1] = "a long prompt of many words that is longer than four tokens"
    done = run(*argv, "--io", "threads")
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1 and needle in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_miss_tier_weight_takes_what_the_library_takes_and_its_help_says_what_large_means() -> None:
    """A weight of 2 is valid (a model that scales its routing weights has weights above 1), in the
    CLI as in :class:`aioexperts.MissTier`; the help does not promise 0..1 and says what a value
    above every weight does."""
    import aioexperts
    from aioexperts.cli import serve
    from aioexperts.cli._common import gate_weight
    from aioexperts.cli.run import build_parser

    assert gate_weight("2") == 2.0 == aioexperts.MissTier(path="x", max_gate_weight=2).max_gate_weight
    for parser in (build_parser(), serve.build_parser()):
        (action,) = [a for a in parser._actions if "--miss-tier-weight" in a.option_strings]
        assert action.help is not None and "(0..1)" not in action.help
        assert "above every weight (1 for most models) sends every demand miss low" in action.help
        assert "expert_weights_scale" in action.help


def test_sigint_while_a_chat_waits_for_input_exits_130(tiny_full_model: Path) -> None:
    proc = subprocess.Popen(
        [*COMMAND, str(tiny_full_model), "--chat", "-n", "3", "--io", "threads"],
        stdin=subprocess.PIPE,  # kept open: the chat waits for a line that never comes
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        seen = b""
        deadline = time.monotonic() + 120
        while b"> " not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stderr.fileno(), 4096)
                if not chunk:
                    break
                seen += chunk
        assert b"> " in seen, seen.decode()
        proc.send_signal(signal.SIGINT)
        # a blocked stdin read must not keep it alive; stdin stays open (communicate() closes it,
        # and the chat could then end on the end of file before the signal is handled: exit 0)
        proc.wait(timeout=20)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert proc.returncode == 130, err.decode()
    assert "interrupted (Ctrl-C)" in (seen + err).decode()


@pytest.mark.parametrize(
    ("redirect", "args", "needle"),
    [(">&-", ["-p", "hi"], "standard output is closed"), ("0<&-", ["--chat"], "standard input, which is closed")],
    ids=["stdout", "stdin"],
)
def test_a_closed_standard_stream_is_one_line_and_exit_2(
    tiny_full_model: Path, redirect: str, args: list[str], needle: str
) -> None:
    """``aioexperts-run ... >&-`` or ``--chat 0<&-``: Python starts with that stream as None."""
    shell = " ".join([*COMMAND, str(tiny_full_model), *args, "--io", "threads", redirect])
    done = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and "Traceback" not in done.stderr


def _read_terminal(fd: int, until: Any, timeout: float) -> bytes:
    """Read the terminal's master side until ``until(seen)`` or EOF (the child exited) or ``timeout``."""
    seen = b""
    deadline = time.monotonic() + timeout
    while not until(seen) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child's side is closed
                break
            if not chunk:
                break
            seen += chunk
    return seen


@pytest.mark.parametrize("key", [b"\x03", b"\x04"], ids=["ctrl-c", "ctrl-d"])
def test_an_idle_chat_prompt_on_a_terminal_ends_at_once_on_ctrl_c_or_ctrl_d(tiny_full_model: Path, key: bytes) -> None:
    """On a real (pseudo-)terminal, Ctrl-C typed at the ``> `` prompt exits 130 without waiting for
    Enter (the stdin reader does not hold the exit up); Ctrl-D exits 0; either way the statistics
    start on a line of their own."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is its controlling terminal, stdin, stdout and stderr
        os.execv(sys.executable, [*COMMAND, str(tiny_full_model), "--chat", "-n", "3", "--io", "threads"])
    done = (0, 0)
    try:
        seen = _read_terminal(fd, lambda b: b.endswith(b"> "), 120)
        assert seen.endswith(b"> "), seen.decode()
        os.write(fd, key)  # typed: the terminal sends SIGINT, or ends the input
        seen += _read_terminal(fd, lambda b: False, 20)  # until the child exits (no Enter is ever typed)
        deadline = time.monotonic() + 5
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done[0] == pid, "still running: it waits for Enter\n" + seen.decode(errors="replace")
        status = os.waitstatus_to_exitcode(done[1])
    finally:
        if done[0] != pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    text = seen.decode(errors="replace").replace("\r\n", "\n")
    assert status == (130 if key == b"\x03" else 0), text
    assert re.search(r"^prompt: ", text, re.MULTILINE), text  # not "> prompt: ..." nor "> ^Cprompt: ..."
    assert "Traceback" not in text


def test_the_miss_tier_serves_misses_and_is_reported(tiny_full_model: Path, tmp_path: Path) -> None:
    from aioexperts import write_miss_tier

    sidecar = write_miss_tier(tiny_full_model, tmp_path / "tier.gguf", "Q3_K")
    base = (str(tiny_full_model), "-p", "Once upon a time", "-n", "4", "--temp", "0", "--io", "threads")
    fits = run(*base, "--miss-tier", str(sidecar), "--json")  # the default slab holds all 8 experts: tier off
    assert fits.returncode == 0, fits.stderr
    ex = json.loads(fits.stdout)["experts"]
    assert "every routed expert" in ex["miss_tier_off_reason"] and ex["low_tier_misses"] == 0
    assert "miss tier off: the slab holds every routed expert" in run(*base, "--miss-tier", str(sidecar)).stderr
    args = (*base, "--slots", "6")  # of 8 experts: the tier serves
    done = run(*args, "--miss-tier", str(sidecar), "--json")
    assert done.returncode == 0, done.stderr
    ex = json.loads(done.stdout)["experts"]
    assert ex["miss_tier_off_reason"] is None
    assert 0 < ex["low_tier_misses"] <= ex["demand_misses"] and ex["tier_upgrades"] >= 0
    assert 0 <= ex["low_tier_prefetch_hits"] <= ex["prefetched_in_time"] + ex["prefetched_late"]
    assert 0 <= ex["low_tier_prefetches"] <= ex["prefetch_issued"]
    assert ex["tier_upgrades_deferred"] >= 0
    human = run(*args, "--miss-tier", str(sidecar))
    line = (
        r"\d+ demand miss(?:es)?, \d+ of them from the low tier \(\d+ upgrades? started\); \d+ prefetched from the low "
        r"tier, \d+ upgrades? put off while the reads were behind; stalled on reads"
    )
    assert re.search(line, human.stderr), human.stderr
    stale = run(*args, "--miss-tier", str(tiny_full_model))  # not a sidecar: one clear line, no traceback
    assert stale.returncode != 0 and "not a miss-tier sidecar" in stale.stderr and "Traceback" not in stale.stderr


def test_a_chat_turn_past_ctx_is_skipped_with_one_line_and_the_chat_goes_on(tiny_full_model: Path) -> None:
    """A later turn that makes the conversation longer than --ctx is refused alone (one error line
    naming the tokens, the limit and what to do); the turns before and after it run, exit 0."""
    long = "the quick brown fox jumps over the lazy dog " * 2
    done = run(
        *(str(tiny_full_model), "--chat", "-n", "4", "--temp", "0", "--io", "threads", "--ctx", "40", "--json"),
        stdin=f"Hi\n{long}\nHi\n",
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, done.stderr
    assert re.search(r"the conversation is \d+ tokens, more than n_ctx=40 positions \(--ctx 40\)", errors[0])
    assert "skipped" in errors[0] and "larger --ctx" in errors[0]
    turns = json.loads(done.stdout)["turns"]
    assert [t["user"] for t in turns] == ["Hi", long, "Hi"]
    assert turns[0]["error"] is None and turns[0]["generated_tokens"] > 0
    assert turns[1]["error"] in errors[0] and turns[1]["generated_tokens"] == 0 and turns[1]["assistant"] == ""
    assert turns[2]["error"] is None and turns[2]["generated_tokens"] > 0
    assert turns[2]["reused_tokens"] > 0  # the skipped turn left the conversation (and its KV cache) as it was


def test_a_system_message_longer_than_ctx_is_refused_before_the_model_loads(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--chat without -p: the first turn comes from stdin, but --system alone must fit --ctx."""
    import aioexperts
    from aioexperts.cli.run import main

    async def no_start(self: aioexperts.Model) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(aioexperts.Model, "start", no_start)
    system = "the quick brown fox jumps over the lazy dog " * 3
    assert main([str(tiny_full_model), "--chat", "--system", system, "--ctx", "16", "--io", "threads"]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(r"--system takes \d+ tokens in the chat template", lines[0]), lines[0]
    assert "more than n_ctx=16 positions (--ctx 16)" in lines[0] and "the model was not loaded" in lines[0]


def test_the_stop_string_that_ended_generation_is_reported(tiny_full_model: Path) -> None:
    base = (str(tiny_full_model), "-p", "Once upon a time", "-n", "8", "--temp", "0", "--io", "threads")
    free = json.loads(run(*base, "--json").stdout)
    assert free["stop_string"] is None
    stop = free["text"][2:4]  # greedy: the same text again, cut where this first occurs
    assert len(stop) == 2, free["text"]
    cut = run(*base, "--json", "--stop", stop)
    report = json.loads(cut.stdout)
    assert report["stop_reason"] == "stop" and report["stop_string"] == stop, cut.stderr
    human = run(*base, "--stop", stop)
    assert f"stop: stop (at {stop!r})" in human.stderr, human.stderr


def test_no_expert_requests_is_no_hit_rate(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A chat that ends before its first turn made no expert request: the hit rate is n/a (null), not 0.0%."""
    import io

    from aioexperts.cli.run import main

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main([str(tiny_full_model), "--chat", "--io", "threads"]) == 0
    err = capsys.readouterr().err
    assert "experts: hit rate n/a (0 hits, 0 joined a read under way, 0 misses of 0 requests)" in err, err
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main([str(tiny_full_model), "--chat", "--io", "threads", "--json"]) == 0
    ex = json.loads(capsys.readouterr().out)["experts"]
    assert ex["requests"] == 0 and ex["hit_rate"] is None


def test_counts_of_one_are_singular() -> None:
    from aioexperts.cli._common import plural

    assert plural(1, "token") == "1 token" and plural(0, "token") == "0 tokens" and plural(2, "token") == "2 tokens"
    assert plural(1, "miss", "misses") == "1 miss" and plural(3, "miss", "misses") == "3 misses"


def test_a_prompt_that_fills_n_ctx_exits_2_before_loading(tiny_full_model: Path) -> None:
    """It ran, prefilled 0 tokens, generated none and exited 0; one position more generates one token."""
    import aioexperts

    n = len(aioexperts.Tokenizer.from_gguf(tiny_full_model).encode("hi", add_special=True))
    done = run(str(tiny_full_model), "-p", "hi", "--ctx", str(n), "--io", "threads")
    assert done.returncode == 2, done.stderr
    assert f"all of n_ctx={n} positions (--ctx {n}), with none left" in done.stderr and "Traceback" not in done.stderr
    done = run(str(tiny_full_model), "-p", "hi", "--ctx", str(n + 1), "-n", "4", "--io", "threads")
    assert done.returncode == 0 and "generation: 1 token" in done.stderr, done.stderr


def test_a_prompt_file_that_is_not_regular_or_too_large_for_ctx_is_refused_unread(
    tiny_full_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-f /dev/zero`` grew without bound, and a large file was read whole and tokenized: a file that
    is not regular is refused, and one of more than MAX_PROMPT_BYTES_PER_POSITION bytes per position
    of n_ctx is refused from its size (and stdin, ``-f -``, from its first bytes past the bound)."""
    import io

    from aioexperts.cli import run as run_cli

    limit = run_cli.MAX_PROMPT_BYTES_PER_POSITION * 16
    big = tmp_path / "big.txt"
    big.write_text("a" * (limit + 1))

    class Stdin:
        buffer = io.BytesIO(b"a" * (limit + 100))

    monkeypatch.setattr(sys, "stdin", Stdin())
    for args, needle in (
        (["-f", "/dev/zero"], "-f /dev/zero: not a regular file (a device, a FIFO): give a file, or -f - for stdin"),
        (["-f", str(tmp_path)], f"-f {tmp_path}: is a directory, not a prompt file"),
        (["-f", str(big)], f"-f {big}: the prompt is {limit + 1} bytes, more than n_ctx=16 positions (--ctx 16) can"),
        (["-f", "-"], f"-f -: the prompt is more than {limit} bytes, more than n_ctx=16 positions (--ctx 16) can"),
    ):
        assert run_cli.main([str(tiny_full_model), *args, "--ctx", "16", "--io", "threads"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and needle in err, err
        assert "not truncated" in err or "not a regular" in err or "directory" in err, err
    assert Stdin.buffer.tell() == limit + 1  # stdin was read up to one byte past the bound, no further
    with pytest.raises(SystemExit) as exit_:
        run_cli.main([str(tiny_full_model), "-f", "-", "--chat"])
    assert exit_.value.code == 2
    assert "-f - reads the prompt from stdin, where --chat reads the turns" in capsys.readouterr().err


def test_a_prompt_from_stdin_with_f_dash(tiny_full_model: Path) -> None:
    done = run(str(tiny_full_model), "-f", "-", "-n", "1", "--io", "threads", "--json", stdin="Once upon\r\na time")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prompt_tokens"] > 1


@pytest.mark.parametrize("absorbed", [False, True])
def test_ctrl_c_exits_130_even_when_the_session_absorbs_the_cancellation(
    absorbed: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CI run saw Ctrl-C at the chat prompt print "interrupted" and exit 0: the cancellation did
    not come out of the session. The status follows the Ctrl-C, not how the session ended."""
    import argparse
    import asyncio

    from aioexperts.cli import run as run_module

    async def session(args: object, path: object, prompt: object, report: Any) -> None:
        report.at_prompt = True
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if not absorbed:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]

    async def main() -> int:
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
        return await run_module._run(argparse.Namespace(), "m.gguf", None, report)

    monkeypatch.setattr(run_module, "_session", session)
    report = run_module._Report("m.gguf", False)
    assert asyncio.run(main()) == 130
    assert report.interrupted
    assert capsys.readouterr().err == "\n"  # the statistics start a line of their own after "> "


def test_a_ctrl_c_handled_after_the_session_ended_still_exits_130(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CI flake behind the test above: the chat ended on stdin's end of file, then the SIGINT
    sent with it was handled while the event loop shut down: "interrupted (Ctrl-C)" was printed
    and the exit status was 0. The status follows the report."""
    from aioexperts.cli import run as run_module

    async def ended_then_interrupted(args: object, path: object, prompt: object, report: Any) -> int:
        report.interrupted = True  # what on_sigint does, after _run had decided its status
        return 0

    monkeypatch.setattr(run_module, "_run", ended_then_interrupted)
    assert run_module.main([str(tiny_full_model), "--chat", "--io", "threads"]) == 130
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err
