"""What ``GET /health`` says about the expert reads: ``ok`` until a generation fails on an expert read.

A generation that fails with :class:`~aioexperts.ExpertReadError` (the model file truncated, replaced
or unreadable under the server, a failing disk, a lost expert shard) makes :class:`Health` report the
failure: ``/health`` answers 503 with an error object naming it, as llama.cpp's server answers a
non-ok status while it cannot serve, so a load balancer stops sending requests. The next generation
that ends normally clears it (the store stays usable after a failed read: a file put back heals).
A cancelled generation, or one that failed for another reason, changes nothing.
"""

from __future__ import annotations

from typing import Any

from aioexperts import ExpertReadError

__all__ = ("Health",)


class Health:
    """The last expert-read failure of a generation, until a generation succeeds.

    Single event loop: called from the server's handlers only.
    """

    def __init__(self) -> None:
        self._failure: ExpertReadError | None = None

    @property
    def failure(self) -> ExpertReadError | None:
        """The read error of the last failed generation, or None (healthy)."""
        return self._failure

    def failed(self, exc: ExpertReadError) -> None:
        """A generation failed on an expert read: ``/health`` reports it from now on."""
        self._failure = exc

    def succeeded(self) -> None:
        """A generation ended normally: ``/health`` answers ``ok`` again."""
        self._failure = None

    def response(self) -> tuple[int, dict[str, Any]]:
        """``(HTTP status, JSON body)`` of ``GET /health``: ``(200, {"status": "ok"})``, or 503 with
        ``{"status": "error", "error": {"message", "type": "unavailable_error", "param", "code":
        "expert_read_failed"}}`` while the last generation's expert read failed."""
        exc = self._failure
        if exc is None:
            return 200, {"status": "ok"}
        message = f"generations fail: {type(exc).__name__}: {exc}"
        error = {"message": message, "type": "unavailable_error", "param": None, "code": "expert_read_failed"}
        return 503, {"status": "error", "error": error}
