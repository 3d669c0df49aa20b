"""``aioexperts-serve`` as a command: the built-in model when none is named, ``--port 0``, SIGTERM
(in-flight requests finish up to the deadline, the rest are cancelled, the model is closed, exit
0), and bad arguments as one line with exit status 2."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aioexperts._compute.jit import cache_dir
from aioexperts.cli.serve import main
from aioexperts.testing._full_model import FULL_SPEC
from serve.serving import RawStream

COMMAND = [sys.executable, "-m", "aioexperts.cli.serve"]


def read_stderr_until(proc: subprocess.Popen[bytes], pattern: str, timeout: float = 120) -> re.Match[str]:
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            chunk = os.read(proc.stderr.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
            found = re.search(pattern, seen.decode())
            if found:
                return found
    raise AssertionError(f"{pattern!r} not in stderr: {seen.decode()}")


def test_sigterm_lets_short_requests_finish_and_cancels_the_rest_at_the_deadline(
    tiny_full_model: Path, tmp_path: Path
) -> None:
    """No MODEL: the built-in model's cache file is served (a small one put in its place, as in test_run)."""
    shutil.copy(tiny_full_model, tmp_path / FULL_SPEC.with_(n_layer=2).file_name())
    (tmp_path / "numba").symlink_to(cache_dir().parent)  # this session's compiled kernels
    env = {**os.environ, "AIOEXPERTS_CACHE": str(tmp_path)}
    proc = subprocess.Popen(
        [*COMMAND, "--layers", "2", "--port", "0", "--io", "threads", "--parallel", "2", "--shutdown-timeout", "1"]
        + ["--ctx", "4096"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        found = read_stderr_until(proc, r"listening on http://127\.0\.0\.1:(\d+)")
        address = ("127.0.0.1", int(found.group(1)))
        # long: far more tokens than the 1 s deadline allows (the tiny model decodes about 1,000 tokens
        # a second here; "Tell me everything." ended at its 2,014th token, in time on a quiet Zen 4;
        # greedy "Write forever." reaches 4,000 without an end of generation)
        long = RawStream(
            address,
            "/v1/completions",
            {"prompt": "Write forever.", "max_tokens": 4000, "temperature": 0, "stream": True},
            key=None,
        )
        short = RawStream(address, "/v1/completions", {"prompt": "Hi", "max_tokens": 12, "stream": True}, key=None)
        long.read_until(b"data: ")
        short.read_until(b"data: ")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        done = short.read_all()  # finished within the deadline: [DONE] and the last (empty) chunk
        assert b"data: [DONE]\n\n" in done and done.endswith(b"\r\n0\r\n\r\n")
        cut = long.read_all()  # cancelled at the deadline: an error event says why, then [DONE]
        assert b'"code": "shutting_down"' in cut and cut.rstrip(b"\r\n0").endswith(b"data: [DONE]")
        assert cut.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the terminating chunk: not cut off
        assert time.monotonic() - t0 < 10
        long.close()
        short.close()
        with pytest.raises(ConnectionRefusedError):  # no longer listening
            RawStream(address, "/health", {}, key=None).read_until(b"HTTP/1.1 200")
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.decode()
    assert proc.returncode == 0, stderr
    assert (
        "SIGTERM: stopping" in stderr
        and "cancelled 1 generation still running at the deadline" in stderr
        and "stopped" in stderr
    )
    assert "Traceback" not in stderr


def start_builtin(tmp_path: Path, tiny_full_model: Path, *args: str) -> tuple[subprocess.Popen[bytes], tuple[str, int]]:
    shutil.copy(tiny_full_model, tmp_path / FULL_SPEC.with_(n_layer=2).file_name())
    (tmp_path / "numba").symlink_to(cache_dir().parent)  # this session's compiled kernels
    env = {**os.environ, "AIOEXPERTS_CACHE": str(tmp_path)}
    proc = subprocess.Popen(
        [*COMMAND, "--layers", "2", "--port", "0", "--io", "threads", "--ctx", "4096", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    found = read_stderr_until(proc, r"listening on http://127\.0\.0\.1:(\d+)")
    return proc, ("127.0.0.1", int(found.group(1)))


def test_a_second_signal_ends_the_streams_with_shutting_down_and_exits_1(tiny_full_model: Path, tmp_path: Path) -> None:
    """The second SIGTERM cancels the running streams at once: each ends with a shutting_down event,
    [DONE] and the terminating chunk (never internal_error: the model is closed after them). A
    connection kept open from before the first signal gets 503 with Connection: close."""
    proc, address = start_builtin(tmp_path, tiny_full_model, "--parallel", "2", "--shutdown-timeout", "60")
    try:
        kept = http.client.HTTPConnection(*address, timeout=60)
        kept.request("GET", "/health")
        assert kept.getresponse().read() == b'{"status": "ok"}'
        body = {"prompt": "Tell me everything.", "max_tokens": 4000, "temperature": 0, "stream": True}
        streams = [RawStream(address, "/v1/completions", body, key=None) for _ in range(2)]
        for stream in streams:
            stream.read_until(b"data: ")
        proc.send_signal(signal.SIGTERM)
        read_stderr_until(proc, "SIGTERM: stopping")
        kept.request("GET", "/v1/models")
        refused = kept.getresponse()
        assert refused.status == 503 and refused.getheader("Connection") == "close"
        assert json.loads(refused.read())["error"]["code"] == "shutting_down"
        kept.close()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for stream in streams:
            cut = stream.read_all()
            stream.close()
            assert b'"code": "shutting_down"' in cut and b"internal_error" not in cut, cut[-400:]
            assert cut.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), cut[-200:]
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.decode()
    assert proc.returncode == 1, stderr
    assert "cancelled 2 generations still running at the second signal" in stderr, stderr
    assert "stopped at once (second signal)" in stderr, stderr
    assert "Traceback" not in stderr and "store is closed" not in stderr, stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "70000"], "--port: must be a TCP port"),
        (["MODEL", "--host", "not..an..addr"], "--host 'not..an..addr': not an address or host name to bind"),
        (["MODEL", "--host", "999.1.1.1"], "--host '999.1.1.1': not an address or host name to bind ("),
        (["--parallel", "0"], "--parallel: must be >= 1"),
        (["/no/such/model.gguf"], "no such model file"),
        (["MODEL", "--layers", "2"], "built-in model"),
        (["MODEL", "--shutdown-timeout", "-1"], "--shutdown-timeout must be seconds >= 0"),
        (["MODEL", "--api-key", ""], "--api-key must be a non-empty str"),
        # an empty alias was taken and the file name served under it, without a word
        (["MODEL", "--alias", ""], "--alias must be a non-empty str"),
        (["MODEL", "--alias", "  "], "--alias must be a non-empty str"),
        (["MODEL", "--max-body-bytes", str(1 << 41)], "--max-body-bytes must be an int in"),
        (["MODEL", "--prompt-cache-bytes", "-1"], "--prompt-cache-bytes: must be >= 0"),
        (["MODEL", "--prompt-cache-bytes", str(1 << 51)], "--prompt-cache-bytes must be an int in"),
        (["MODEL", "--reasoning-format", "xml"], "--reasoning-format: invalid choice: 'xml'"),
        # the miss tier's options were accepted and ignored
        (["MODEL", "--miss-tier", "/no/such/tier.gguf"], "--miss-tier /no/such/tier.gguf: no such file"),
        (["MODEL", "--miss-tier", "."], "--miss-tier .: is a directory, not a sidecar"),
        (["MODEL", "--miss-tier", "/dev/null"], "--miss-tier /dev/null: not a regular file"),
        (["MODEL", "--miss-tier-weight", "0.1"], "--miss-tier-weight needs --miss-tier"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    tiny_full_model: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    argv = [str(tiny_full_model) if a == "MODEL" else a for a in args]
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's errors
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert "[Errno" not in err, err


def test_the_miss_tier_option_is_what_the_server_reads_with(tiny_full_model: Path, tmp_path: Path) -> None:
    """``--miss-tier`` was accepted and ignored: every miss read in full (0 low in /metrics)."""
    from aioexperts import write_miss_tier

    sidecar = write_miss_tier(tiny_full_model, tmp_path / "tier.gguf", "Q2_K")
    proc = subprocess.Popen(
        [*COMMAND, str(tiny_full_model), "--port", "0", "--io", "threads", "--miss-tier", str(sidecar), "--slots", "6"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        address = ("127.0.0.1", int(read_stderr_until(proc, r"listening on http://127\.0\.0\.1:(\d+)").group(1)))
        stream = RawStream(address, "/v1/completions", {"prompt": "Hello there", "max_tokens": 4}, key=None)
        done = stream.read_all()
        stream.close()
        assert b"HTTP/1.1 200" in done, done[:300]
        metrics = http.client.HTTPConnection(*address, timeout=60)
        metrics.request("GET", "/metrics")
        text = metrics.getresponse().read().decode()
        metrics.close()
        counts = {
            name: float(value)
            for name, value in re.findall(r"^aioexperts_(expert_low_tier_\w+_total) (\S+)$", text, re.MULTILINE)
        }
        assert counts["expert_low_tier_misses_total"] + counts["expert_low_tier_prefetches_total"] > 0, text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_without_aiohttp_it_says_which_extra_to_install(tiny_full_model: Path) -> None:
    code = (
        "import sys; sys.modules['aiohttp'] = None; from aioexperts.cli.serve import main; "
        f"sys.exit(main([{str(tiny_full_model)!r}, '--port', '0']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "pip install 'aioexperts[server]'" in done.stderr and "Traceback" not in done.stderr


def test_a_port_in_use_is_said_before_the_model_loads(
    tiny_full_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import aioexperts

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded although the port is taken")

    monkeypatch.setattr(aioexperts, "load", no_load)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        status = main([str(tiny_full_model), "--host", "127.0.0.1", "--port", str(port)])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in lines[0], err


def test_a_signal_during_the_load_stops_before_the_port_opens(
    tiny_full_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import aioexperts

    class LoadInterrupted:  # the load, with SIGTERM arriving while it runs
        async def __aenter__(self) -> object:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.05)  # the loop runs the signal handler
            return object()

        async def __aexit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(aioexperts, "load", lambda *a, **k: LoadInterrupted())
    status = main([str(tiny_full_model), "--port", "0"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "stopped before serving" in err and "listening" not in err, err
