"""``GET /health`` tells when generations fail on expert reads, and is ``ok`` again after one succeeds.

The model file is truncated under a running server (before any expert was read into the slab: each
test has a server of its own), so every generation fails with ``ExpertReadError``; writing the bytes
back heals the store.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from aioexperts.serve import ServerOptions
from serve.serving import RawStream, ServerThread, post, request

TEXT = "/v1/completions"


def health(target: ServerThread) -> tuple[int, dict[str, object]]:
    status, _, data = request(target, "GET", "/health", key=None)  # open without the key
    return status, json.loads(data)


def test_health_reports_failed_expert_reads_until_a_generation_succeeds(serve_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "shrinking.gguf"
    shutil.copyfile(serve_model, path)
    original = path.read_bytes()
    thread = ServerThread(path, ServerOptions(port=0, parallel=1, queue_size=2, prompt_cache_bytes=0)).start()
    try:
        assert health(thread) == (200, {"status": "ok"})
        os.truncate(path, 0)  # the file shrinks under the server: every expert read fails

        status, body = post(thread, TEXT, {"prompt": "Hello", "max_tokens": 2, "temperature": 0}, key=None)
        assert status == 500 and "ExpertReadError" in body["error"]["message"], body
        status, got = health(thread)
        assert status == 503, got
        assert got["status"] == "error"
        error = got["error"]
        assert isinstance(error, dict)
        assert error["type"] == "unavailable_error" and error["code"] == "expert_read_failed"
        assert "ExpertReadError" in error["message"] and str(path) in error["message"], error
        assert health(thread)[0] == 503  # stays failed: asking does not clear it

        with path.open("r+b") as f:  # the bytes come back (same inode): the store reads them again
            f.write(original)
        status, body = post(thread, TEXT, {"prompt": "Hello", "max_tokens": 2, "temperature": 0}, key=None)
        assert status == 200, body
        assert health(thread) == (200, {"status": "ok"})
    finally:
        thread.stop()


def test_a_streamed_generation_that_fails_on_a_read_is_reported(serve_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "shrinking.gguf"
    shutil.copyfile(serve_model, path)
    thread = ServerThread(path, ServerOptions(port=0, parallel=1, queue_size=2, prompt_cache_bytes=0)).start()
    try:
        os.truncate(path, 0)
        stream = RawStream(thread, TEXT, {"prompt": "Hello", "max_tokens": 2, "stream": True}, key=None)
        try:
            received = stream.read_all()
        finally:
            stream.close()
        assert b"HTTP/1.1 200" in received and b"ExpertReadError" in received  # the error came as an event
        status, got = health(thread)
        assert status == 503 and got["status"] == "error", got
    finally:
        thread.stop()
