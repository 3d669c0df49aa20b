"""The server's errors, as OpenAI clients expect them: an HTTP status and an ``error`` object.

Every refusal is an :class:`APIError` (an :class:`~aioexperts.AioExpertsError`); the library's own
errors of a bad request (:class:`~aioexperts.InvalidRequestError`, :class:`~aioexperts.ConfigError`,
:class:`~aioexperts.ChatTemplateError`, :class:`~aioexperts.TokenizerError`) become a 400 through
:func:`api_error`. Every error object has a ``code``.
"""

from __future__ import annotations

from typing import Any

from aioexperts import (
    AioExpertsError,
    ChatTemplateError,
    ConfigError,
    ContextLengthError,
    InvalidRequestError,
    TokenizerError,
)

__all__ = ("APIError", "api_error")


class APIError(AioExpertsError):
    """A request the server refuses, with what the response says.

    Attributes:
        status: the HTTP status (400, 401, 404, 405, 413, 503, 500).
        message: what went wrong, for a person.
        type: the OpenAI error type (``invalid_request_error``, ``authentication_error``,
            ``not_found_error``, ``server_error``).
        param: the request field at fault, or None.
        code: a machine-readable code (``context_length_exceeded``, ``queue_full``, ...), or None.
        headers: extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 (the OpenAI field's name)
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error(exc: BaseException) -> APIError:
    """The :class:`APIError` a response gives for ``exc``: 400 for a bad request, else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, ChatTemplateError):
        return APIError(400, f"the chat template failed: {exc}", param="messages", code="chat_template_error")
    if isinstance(exc, InvalidRequestError | ConfigError | TokenizerError):
        return APIError(400, str(exc), code="invalid_value")
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error", code="internal_error")
