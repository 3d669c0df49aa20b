"""fio replaying the store's reads: the device's own figure for the same work.

The job: ``--read_iolog`` of the recorded :class:`ReadList` (same reads, same order),
``--ioengine=io_uring --direct=1 --iodepth=DEPTH --fixedbufs --registerfiles``, ``--invalidate=0``
(the bench drops the page cache itself, outside fio's clock and CPU counters), and
``--number_ios=N``: without it fio 3.33 stops counting once the log is exhausted and leaves the
last ``iodepth - 1`` reads out of its byte count (measured here: 137 of 200 reads counted at depth
64). fio 3.33 refuses ``--registerfiles`` with an iolog ("registered files require nr_files to be
identical to open_files"); the job then runs without registered files and says so (registered
files made no measurable difference here, docs/notes/LIBURING.md).

``fio-readv`` adds ``--nonvectored=0`` (``READV_FIXED``, the store's opcode; fio's default is
``READ_FIXED``).

Memory: fio reads into one buffer per I/O unit, ``iodepth`` buffers of the largest read
(``init_io_u_buffers``: ``iodepth * max_bs``); no fio option spreads reads over more memory than
that. The store and the Python replays read into distinct memory as large as all the reads;
``docs/bench.md`` reports what that difference measured on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

from .measure import Clock
from .readlist import ReadList

__all__ = ("FioError", "FioResult", "fio_path", "fio_version", "run_fio_replay")

_REGISTERFILES_REFUSED = "registered files require nr_files"
_TIMEOUT_S = 1800


class FioError(RuntimeError):
    """fio failed: a non-zero exit status, no JSON report, or an error inside its job.

    The message is one line naming fio and what went wrong (its exit status and the last line of
    its stderr); ``stderr`` keeps all of fio's stderr, ``command`` the command line.
    """

    def __init__(self, message: str, command: list[str], stderr: str = "") -> None:
        super().__init__(message)
        self.command = command
        self.stderr = stderr


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _failure(what: str, cmd: list[str], stdout: str, stderr: str) -> FioError:
    said = _last_line(stderr) or _last_line(stdout)
    return FioError(f"fio {what}" + (f": {said}" if said else ""), cmd, stderr)


def fio_path() -> str | None:
    """The ``fio`` executable, or None when it is not installed."""
    return shutil.which("fio")


def fio_version() -> str | None:
    """``fio --version`` (e.g. ``fio-3.33``), or None."""
    fio = fio_path()
    if fio is None:
        return None
    out = subprocess.run([fio, "--version"], capture_output=True, text=True, check=False, timeout=30)
    return out.stdout.strip() or None


@dataclass(frozen=True)
class FioResult:
    """One fio replay.

    Attributes:
        seconds: fio's own runtime of the job (``read.runtime``), s.
        cpu_seconds: fio's own CPU of the job: ``(usr_cpu + sys_cpu) / 100 * runtime``, s.
        process_cpu_seconds: CPU of the whole fio process (start-up, iolog parsing included).
        wall_seconds: wall time of the fio command.
        bytes_read: ``read.io_bytes``.
        n_reads: ``read.total_ios``.
        p50_ms, p99_ms: completion latency percentiles per read, ms.
        command: the command line run.
        registered_files: True when ``--registerfiles`` was accepted.
        buffer_bytes: memory fio read into: ``iodepth * max read``.
    """

    seconds: float
    cpu_seconds: float
    process_cpu_seconds: float
    wall_seconds: float
    bytes_read: int
    n_reads: int
    p50_ms: float | None
    p99_ms: float | None
    command: list[str]
    registered_files: bool
    buffer_bytes: int


def _command(fio: str, iolog: str, depth: int, n_reads: int, register_files: bool, vectored: bool) -> list[str]:
    cmd = [
        fio,
        "--name=aioexperts-replay",
        "--readonly",
        f"--read_iolog={iolog}",
        "--replay_no_stall=1",
        f"--number_ios={n_reads}",
        "--ioengine=io_uring",
        "--direct=1",
        f"--iodepth={depth}",
        "--fixedbufs",
        "--invalidate=0",
        "--output-format=json",
    ]
    if register_files:
        cmd.append("--registerfiles")
    if vectored:
        cmd.append("--nonvectored=0")
    return cmd


def run_fio_replay(reads: ReadList, depth: int, *, vectored: bool = False, workdir: str | None = None) -> FioResult:
    """Replay ``reads`` with fio at ``depth`` (the page cache must be dropped beforehand).

    Args:
        vectored: ``--nonvectored=0``: ``READV_FIXED`` like the store, instead of fio's default
            ``READ_FIXED``.

    Raises:
        FileNotFoundError: fio is not installed.
        FioError: fio exited with a non-zero status, printed no JSON report, reported an error in
            its job, or ran longer than 30 minutes.
    """
    fio = fio_path()
    if fio is None:
        raise FileNotFoundError("fio is not installed")
    fd, iolog = tempfile.mkstemp(prefix="aioexperts-fio-", suffix=".iolog", dir=workdir)
    os.close(fd)
    try:
        reads.write_fio_iolog(iolog)
        register = True
        while True:
            cmd = _command(fio, iolog, depth, len(reads), register, vectored)
            with Clock() as clock:
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    raise FioError(f"fio did not finish within {_TIMEOUT_S} s", cmd) from None
            if out.returncode != 0 and register and _REGISTERFILES_REFUSED in (out.stderr + out.stdout):
                register = False
                continue
            if out.returncode != 0:
                raise _failure(f"exited with status {out.returncode}", cmd, out.stdout, out.stderr)
            break
    finally:
        os.unlink(iolog)
    try:
        job: dict[str, Any] = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
        read = job["read"]
    except (ValueError, LookupError, TypeError):
        raise _failure("printed no JSON report (exit status 0)", cmd, out.stdout, out.stderr) from None
    if job.get("error"):
        raise _failure(f"reported error {job['error']} in its job", cmd, out.stdout, out.stderr)
    seconds = read["runtime"] / 1e3
    pct = read.get("clat_ns", {}).get("percentile", {})
    p50, p99 = pct.get("50.000000"), pct.get("99.000000")
    return FioResult(
        seconds=seconds,
        cpu_seconds=(job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds,
        process_cpu_seconds=clock.child_cpu,
        wall_seconds=clock.seconds,
        bytes_read=int(read["io_bytes"]),
        n_reads=int(read["total_ios"]),
        p50_ms=None if p50 is None else p50 / 1e6,
        p99_ms=None if p99 is None else p99 / 1e6,
        command=cmd,
        registered_files=register,
        buffer_bytes=depth * reads.max_len,
    )
