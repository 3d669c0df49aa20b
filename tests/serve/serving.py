"""Helpers of tests/serve: a real ``aioexperts-serve`` server on 127.0.0.1 (a free port), plain HTTP, /metrics.

The server runs in a thread of its own with its own event loop (aiohttp is asyncio-only), serving
the small built-in full model of tests/conftest.py with one change: its chat template raises for a
``system`` message (so a failing template can be asked for). The tests talk to it over loopback
with the official ``openai`` client and with plain HTTP.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import aioexperts
from aioexperts.serve import Server, ServerOptions

API_KEY = "test-key"

#: ChatML, but a system message makes it raise (transformers' raise_exception).
RAISING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('system messages are not "
    "supported by this template') }}{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ServerThread:
    """:class:`aioexperts.serve.Server` on a loaded model, in a daemon thread."""

    def __init__(
        self, path: Path, options: ServerOptions, n_ctx: int | None = None, *, stop_grace: float = 1.0
    ) -> None:
        self.path = path
        self.stop_grace = stop_grace  # seconds server.stop() lets running generations finish
        self.options = options
        self.n_ctx = n_ctx
        self.url = ""
        self.server: Server | None = None
        self.cancelled_at_stop: int | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            io = aioexperts.IOOptions(backend="threads")
            async with aioexperts.load(self.path, slots=8, io=io, n_ctx=self.n_ctx) as model:
                self.server = Server(model, self.options)
                await self.server.start()
                self.url = self.server.url
                self._ready.set()
                await self._stop.wait()
                self.cancelled_at_stop = await self.server.stop(self.stop_grace)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            raise

    def start(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None:
            raise self._error
        assert self.url, "the server did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the server thread did not stop"

    @property
    def host_port(self) -> tuple[str, int]:
        assert self.server is not None
        return self.options.host, self.server.port


def request(
    target: ServerThread,
    method: str,
    path: str,
    body: Any = None,
    *,
    key: str | None = API_KEY,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP request: (status, headers, body)."""
    conn = http.client.HTTPConnection(*target.host_port, timeout=120)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if key is not None:
            hdrs["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def post(target: ServerThread, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
    status, _, data = request(target, "POST", path, body, **kw)
    return status, json.loads(data)


_SAMPLE = re.compile(r"^(aioexperts_[a-z_]+)(\{[^}]*\})? (\S+)$")


def metrics(target: ServerThread) -> dict[str, float]:
    """``GET /metrics`` parsed: ``name`` or ``name{labels}`` -> value; every line checked against the format."""
    status, headers, data = request(target, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[str, float] = {}
    for line in data.decode().splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _SAMPLE.match(line)
        assert m is not None, f"not a Prometheus sample line: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.05) -> Any:
    """Poll ``predicate()`` until it is truthy (returns it) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {predicate}")
        time.sleep(interval)


class RawStream:
    """A request on a bare socket, read as it comes: for clients that go away mid-response."""

    def __init__(self, target: ServerThread | tuple[str, int], path: str, body: Any, *, key: str | None = API_KEY):
        host, port = target.host_port if isinstance(target, ServerThread) else target
        self.sock = socket.create_connection((host, port), timeout=60)
        data = json.dumps(body).encode()
        auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        self.sock.sendall(head.encode() + data)
        self.received = b""

    def read_until(self, needle: bytes, count: int = 1) -> bytes:
        """Read until ``needle`` was received ``count`` times (or the peer closed); returns all so far."""
        while self.received.count(needle) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.received += chunk
        return self.received

    def read_all(self) -> bytes:
        while chunk := self.sock.recv(65536):
            self.received += chunk
        return self.received

    def close(self) -> None:
        self.sock.close()


def open_fds() -> int:
    """File descriptors this process has open."""
    return len(os.listdir("/proc/self/fd"))
