"""The aiohttp application: routes, the API-key and error middlewares, and the :class:`Server`.

Routes (docs/serving.md): ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/messages``
and ``POST /v1/messages/count_tokens`` (Anthropic's, :mod:`aioexperts.serve._anthropic`), ``GET /v1/models``,
``GET /health``, ``GET /props``, ``POST /tokenize``, ``POST /detokenize``, ``POST /apply-template``,
``GET /metrics``. Every refusal is an OpenAI error object (:mod:`aioexperts.serve._errors`), in
Anthropic's shape on the ``/v1/messages`` paths.

A request is checked and its prompt tokenized (on one text worker thread, off the event loop)
before it asks the :class:`~aioexperts.serve._scheduler.Scheduler` for a slot, so a bad request is
refused at once and never waits in the queue. The handler task of a request whose client goes
away is cancelled (aiohttp's ``handler_cancellation``): its generation stops at the step it is in
and its sequence's KV cache is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

import aioexperts
from aioexperts import AioExpertsError, Model, TokenConstraint
from aioexperts._json import dumps as strict_dumps

from ._anthropic import AnthropicMessages, is_anthropic_path
from ._errors import APIError, api_error
from ._generate import Generation, SamplerFactory
from ._health import Health
from ._metrics import CONTENT_TYPE, Metrics
from ._openai import Piece, Shapes
from ._prompt import ChatPrompt, chat_prompt
from ._prompt_cache import PromptCache, default_capacity_bytes
from ._replies import ChatReply
from ._scheduler import Scheduler
from ._structured import compile_structured
from ._validate import (
    GenerationRequest,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json,
    parse_tokenize,
)

__all__ = ("DEFAULT_HOST", "DEFAULT_PORT", "Server", "ServerOptions")

log = logging.getLogger("aioexperts.serve")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_PROMPT_CACHE_SEQUENCES = 16
"""The default prompt cache holds this many sequences at most."""

#: Paths answered without the API key (a load balancer's probe).
_OPEN_PATHS = frozenset({"/health"})
#: request key: set once a streamed reply's client left (the reply counts as 499)
CLIENT_GONE = web.RequestKey("aioexperts.client_gone", bool)
#: request key: the connection closes after this request's response (its body was not read whole)
CLOSE_AFTER = web.RequestKey("aioexperts.close_after", bool)

T = TypeVar("T")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """How the server listens and admits requests.

    Attributes:
        host: address to bind (default loopback only).
        port: TCP port; 0 takes a free one (:attr:`Server.port` tells which).
        parallel: generations that decode at once, each with its own KV cache (``>= 1``).
        queue_size: requests that may wait for a slot, first come first served (``>= 0``); more are
            refused with 503.
        api_key: when set, every request but ``GET /health`` needs ``Authorization: Bearer <key>``.
        max_body_bytes: larger request bodies are refused with 413 (a larger ``Content-Length`` at
            once, before any of the body is read).
        body_timeout: seconds a request's body may take to arrive once its headers are in; a
            slower one is refused with 408 and its connection closed (a client that declares a
            body and stalls no longer holds a connection for ever).
        shutdown_timeout: seconds :meth:`Server.stop` lets running generations finish before
            cancelling them.
        model_name: the model's id in ``/v1/models`` and responses, a non-empty str (default: the
            file name).
        prompt_cache_bytes: the prompt cache's budget in bytes of KV cache
            (:mod:`aioexperts.serve._prompt_cache`); 0 turns it off; None: half the memory left
            once the model started and ``parallel`` sequences have their KV cache, at most
            :data:`DEFAULT_PROMPT_CACHE_SEQUENCES` sequences.
        reasoning_format: llama.cpp's ``--reasoning-format``: ``"auto"`` / ``"deepseek"`` return
            ``<think>`` text apart (``reasoning_content``, Anthropic ``thinking`` blocks); ``"none"``
            leaves it in the content (:data:`aioexperts.REASONING_FORMATS`).
        sampler_factory: makes each generation's sampler from its :class:`aioexperts.SamplingOptions`
            (a callable ``(logits, history) -> token id``), instead of :class:`aioexperts.Sampler`:
            for tests that script the model's reply (:class:`aioexperts.testing.ScriptedSampler`).
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    parallel: int = 4
    queue_size: int = 16
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0
    shutdown_timeout: float = 30.0
    model_name: str | None = None
    prompt_cache_bytes: int | None = None
    reasoning_format: str = "auto"
    sampler_factory: SamplerFactory | None = None

    def __post_init__(self) -> None:
        def integer(name: str, low: int, high: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise aioexperts.ConfigError(f"ServerOptions.{name} must be an int in [{low}, {high}], got {value!r}")

        integer("port", 0, 65535)
        integer("parallel", 1, 4096)
        integer("queue_size", 0, 1 << 20)
        integer("max_body_bytes", 1, 1 << 40)
        if self.prompt_cache_bytes is not None:
            integer("prompt_cache_bytes", 0, 1 << 50)
        grace = self.shutdown_timeout
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace >= 0:
            raise aioexperts.ConfigError(f"ServerOptions.shutdown_timeout must be seconds >= 0, got {grace!r}")
        wait = self.body_timeout
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 < wait <= 3600:
            raise aioexperts.ConfigError(f"ServerOptions.body_timeout must be seconds in (0, 3600], got {wait!r}")
        if self.reasoning_format not in aioexperts.REASONING_FORMATS:
            choices = ", ".join(aioexperts.REASONING_FORMATS)
            raise aioexperts.ConfigError(
                f"ServerOptions.reasoning_format must be one of {choices}, got {self.reasoning_format!r}"
            )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise aioexperts.ConfigError("ServerOptions.api_key must be a non-empty str (or None for no key)")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name.strip()):
            raise aioexperts.ConfigError(
                f"ServerOptions.model_name must be a non-empty str (or None for the file name), got {self.model_name!r}"
            )


def _json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=strict_dumps(value), status=status, content_type="application/json", headers=headers)


def _error_response(err: APIError) -> web.Response:
    response = _json_response(err.body(), err.status, err.headers)
    if err.code == "shutting_down":
        response.force_close()  # "Connection: close": the client does not reuse a connection about to close
    return response


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


def _sse(value: Any) -> bytes:
    return b"data: " + strict_dumps(value).encode() + b"\n\n"


class Server:
    """An OpenAI-compatible HTTP server over a started :class:`aioexperts.Model`.

    ``await server.start()`` binds and serves; ``await server.stop()`` stops accepting, lets the
    running generations finish for up to ``shutdown_timeout`` seconds, cancels the rest and
    closes the listener. The model is the caller's: close it after :meth:`stop`.

    Args:
        model: a started model (``async with aioexperts.load(path) as model``).
        options: :class:`ServerOptions`.

    Raises:
        ConfigError: bad options.
    """

    def __init__(self, model: Model, options: ServerOptions | None = None) -> None:
        self.model = model
        self.options = options if options is not None else ServerOptions()
        self.metrics = Metrics()
        self.health = Health()
        self.scheduler = Scheduler(self.options.parallel, self.options.queue_size)
        self.name = self.options.model_name or os.path.basename(model.path)
        self.fingerprint = f"aioexperts-{aioexperts.__version__}"
        self._created = 0  # /v1/models "created": the model file's modification time, read by start()
        self._text_worker: ThreadPoolExecutor | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._stopping = False
        self.prompt_cache: PromptCache | None = None  # made by start()
        self.app = self._build_app()

    # -- life cycle -----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound TCP port (after :meth:`start`)."""
        if self._port is None:
            raise aioexperts.ConfigError("the server is not started")
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port`` (after :meth:`start`)."""
        host = self.options.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    async def start(self) -> None:
        """Build the tokenizer (and the chat template, if the file has one), bind and start serving.

        Raises:
            OSError: the address cannot be bound.
            VocabularyError, OptionalDependencyError: from the model's tokenizer.
        """
        self._text_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aioexperts-serve-text")
        await self._in_text_worker(lambda: self.model.tokenizer)
        self._created = await self._in_text_worker(lambda: _modified(self.model.path))  # stat: off the loop
        budget = self.options.prompt_cache_bytes
        if budget is None:
            limit = await self._in_text_worker(lambda: aioexperts.read_memory_limit(reclaimable=True))
            per_sequence = self.model.n_ctx * self.model.statistics().kv_bytes_per_position
            budget = min(
                default_capacity_bytes(limit.available, per_sequence, self.options.parallel),
                DEFAULT_PROMPT_CACHE_SEQUENCES * per_sequence,
            )
        if budget > 0:
            self.prompt_cache = PromptCache(self.model, budget)
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0, handle_signals=False
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.options.host, self.options.port)
        try:
            await site.start()
        except UnicodeError as exc:  # a host name the IDNA codec refuses (an empty label: "a..b")
            raise OSError(errno.EINVAL, f"--host {self.options.host!r} is not a valid host name ({exc})") from None
        server = site._server  # the asyncio server: the port a request for port 0 got
        sockets = getattr(server, "sockets", None) or ()
        self._port = sockets[0].getsockname()[1] if sockets else self.options.port

    async def stop(self, grace: float | None = None) -> int:
        """Stop gracefully (idempotent): refuse new requests and the queued ones (503), wait up to
        ``grace`` (default ``shutdown_timeout``) seconds for the running generations, cancel the rest.

        Returns:
            How many generations were cancelled at the deadline.
        """
        if self._stopping:
            return 0
        self._stopping = True
        self.scheduler.close()
        runner, self._runner = self._runner, None
        cancelled = 0
        if runner is not None:
            for site in list(runner.sites):
                await site.stop()  # no new connections
            wait = self.options.shutdown_timeout if grace is None else grace
            cancelled = await self.scheduler.drain(wait)
            await runner.cleanup()
        if self._text_worker is not None:
            self._text_worker.shutdown(wait=False, cancel_futures=True)
        if self.prompt_cache is not None:
            self.prompt_cache.clear()
        return cancelled

    def hurry(self) -> None:
        """Cut the grace of a :meth:`stop` under way (or to come) short: the running generations are
        cancelled now, each answered with ``shutting_down`` (a stream ends with that error event and
        ``data: [DONE]``)."""
        self.scheduler.hurry()

    async def _in_text_worker(self, fn: Callable[[], T]) -> T:
        assert self._text_worker is not None
        return await asyncio.get_running_loop().run_in_executor(self._text_worker, fn)

    # -- the application ------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.options.max_body_bytes, middlewares=[self._count, self._errors, self._auth]
        )
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        messages = AnthropicMessages(self)
        app.router.add_post("/v1/messages", messages.create)
        app.router.add_post("/v1/messages/count_tokens", messages.count_tokens)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)
        app.router.add_get("/health", self._health)
        app.router.add_get("/props", self._props)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/apply-template", self._apply_template)
        app.router.add_get("/metrics", self._metrics)
        self._paths = frozenset(resource.canonical for resource in app.router.resources())
        return app

    @web.middleware
    async def _count(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is not None:
            endpoint = resource.canonical
        else:  # no route matched: a wrong method on a known path (405) counts under the path
            endpoint = request.path if request.path in self._paths else "other"
        status = 500
        try:
            response = await handler(request)
            status = 499 if request.get(CLIENT_GONE) else response.status
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # nginx's "client closed request" (or a shutdown past its deadline)
            raise
        finally:
            self.metrics.requests[(endpoint, status)] += 1

    @web.middleware
    async def _errors(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's: 404, 405, 413 (body over client_max_size)
            if exc.status < 400:
                raise
            kind = {401: "authentication_error", 404: "not_found_error"}.get(exc.status, "invalid_request_error")
            code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(
                exc.status, "invalid_request"
            )
            message = exc.text or exc.reason
            if exc.status == 404:
                message = f"{request.method} {request.path}: no such endpoint"
            elif exc.status == 405:
                message = f"{request.method} is not allowed on {request.path}"
            elif exc.status == 413:
                message = f"the request body is larger than the limit of {self.options.max_body_bytes} bytes"
            err = APIError(exc.status, message, type=kind, code=code)
        except (APIError, AioExpertsError) as exc:
            err = api_error(exc)
            if err.status >= 500:
                log.error("%s %s failed: %s", request.method, request.path, exc)
        response = AnthropicMessages.error_response(err) if is_anthropic_path(request.path) else _error_response(err)
        if request.get(CLOSE_AFTER):
            response.force_close()
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        key = self.options.api_key
        if key is not None and request.path not in _OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            scheme, _, token = given.partition(" ")
            if "x-api-key" in request.headers and is_anthropic_path(request.path):  # Anthropic's header
                scheme, token = "bearer", request.headers["x-api-key"]
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                raise APIError(
                    401,
                    "invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>' on /v1/messages) "
                    "with the server's --api-key",
                    type="authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if self._stopping and request.path != "/health":
            raise _shutting_down()
        return await handler(request)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return parse_json(await self.read_body(request))

    async def read_body(self, request: web.Request) -> bytes:
        """The request's body: 413 at once for a ``Content-Length`` above the limit, 408 (and the
        connection closed) when it takes longer than ``body_timeout``, 400 when it cannot be decoded.

        Raises:
            web.HTTPRequestEntityTooLarge: the declared or read length is over ``max_body_bytes``.
            APIError: 408 ``request_timeout``; 400 ``invalid_body``.
        """
        limit = self.options.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            request[CLOSE_AFTER] = True  # the body is never read: no keep-alive
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared)
        try:
            async with asyncio.timeout(self.options.body_timeout):
                return await request.read()
        except TimeoutError:
            request[CLOSE_AFTER] = True  # the rest of the body is never read: no keep-alive
            wait = self.options.body_timeout
            raise APIError(408, f"the request body did not arrive within {wait:g} s", code="request_timeout") from None
        except (web.RequestPayloadError, BadHttpMessage) as exc:  # an undecodable Content-Encoding
            raise APIError(400, f"the request body could not be read: {exc}", code="invalid_body") from None

    # -- completions ----------------------------------------------------------------------------

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        """Runs on the text worker: render and tokenize (chat) or tokenize (completions)."""
        model = self.model
        if req.chat:
            ids = model.apply_chat_template(list(req.messages), add_generation_prompt=True, tokenize=True)
            assert isinstance(ids, list)
            return ids
        if isinstance(req.prompt, str):
            return model.tokenizer.encode(req.prompt, add_special=True, parse_special=True)
        bad = [t for t in req.prompt if t >= model.n_vocab]
        if bad:
            raise APIError(
                400,
                f"'prompt': token id {bad[0]} is out of range 0..{model.n_vocab - 1}",
                param="prompt",
                code="invalid_value",
            )
        return list(req.prompt)

    def _fit(self, req: GenerationRequest, n_prompt: int) -> int:
        """``max_tokens`` of the request, after refusing a prompt plus ``max_tokens`` beyond ``n_ctx``."""
        n_ctx = self.model.n_ctx
        param = "messages" if req.chat else "prompt"
        where = "messages" if req.chat else "prompt"
        if req.max_tokens is None:
            if n_prompt >= n_ctx:
                raise APIError(
                    400,
                    f"this model's context is {n_ctx} tokens, and the {where} alone is {n_prompt}: "
                    "nothing is truncated; shorten it (or start the server with a larger --ctx)",
                    param=param,
                    code="context_length_exceeded",
                )
            return n_ctx - n_prompt
        if n_prompt + req.max_tokens > n_ctx:
            raise APIError(
                400,
                f"this model's context is {n_ctx} tokens, but {n_prompt + req.max_tokens} were asked for "
                f"({n_prompt} in the {where}, {req.max_tokens} in the completion): nothing is truncated; "
                "lower max_tokens or shorten the prompt (or start the server with a larger --ctx)",
                param=param,
                code="context_length_exceeded",
            )
        return req.max_tokens

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_chat(await self._body(request)))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_completion(await self._body(request)))

    def _chat_prompt(self, req: GenerationRequest) -> ChatPrompt:
        """Runs on the text worker: the chat request rendered (tools, ``chat_template_kwargs``) and tokenized."""
        return chat_prompt(self.model, req.messages, req.tools, req.tool_choice, req.template_kwargs)

    def generation(
        self, ids: list[int], req: GenerationRequest, max_tokens: int, constraint: TokenConstraint | None = None
    ) -> Generation:
        """A :class:`Generation` of ``ids`` for ``req`` (call inside a scheduler slot), on a sequence
        of the prompt cache when there is one, its tokens constrained by ``constraint`` (structured
        output) when given."""
        self.metrics.prompt_tokens += len(ids)
        top = req.top_logprobs if req.logprobs else None
        param = req.structured.param if req.structured is not None else "grammar"
        return Generation(
            self.model, ids, req.options, max_tokens, top, self.metrics.token, self.prompt_cache, constraint,
            self.options.sampler_factory, self.health, param,
        )  # fmt: skip

    async def _complete(self, request: web.Request, req: GenerationRequest) -> web.StreamResponse:
        prompt = await self._in_text_worker(lambda: self._chat_prompt(req)) if req.chat else None
        ids = prompt.ids if prompt is not None else await self._in_text_worker(lambda: self._prompt_ids(req))
        max_tokens = self._fit(req, len(ids))
        spec = req.structured
        constraint = None
        if spec is not None:
            tok, n_vocab = self.model.tokenizer, self.model.n_vocab
            constraint = await self._in_text_worker(lambda: compile_structured(spec, tok, n_vocab))
        shapes = Shapes(req.chat, self.name, self.model.tokenizer, req.logprobs, req.top_logprobs, self.fingerprint)
        reply = None
        if prompt is not None:
            reply = ChatReply(shapes, prompt, self.options.reasoning_format, req.include_usage)
        async with self.scheduler.slot():
            gen = self.generation(ids, req, max_tokens, constraint)
            try:
                if req.stream:
                    return await self._stream(request, req, gen, shapes, reply)
                async with aclosing(gen.pieces()) as stream:
                    pieces = [piece async for piece in stream]
                if reply is not None:
                    return _json_response(reply.whole(pieces, gen.finish_reason, gen.usage))
                return _json_response(shapes.whole(pieces, gen.finish_reason, gen.usage))
            except ConnectionResetError:
                self.metrics.cancelled += 1
                raise
            except asyncio.CancelledError:
                if req.stream or not self.answer_shutdown_cancel():
                    self.metrics.cancelled += 1
                    raise
                return _error_response(_shutting_down())  # cancelled at the shutdown deadline: told why

    async def _stream(
        self, request: web.Request, req: GenerationRequest, gen: Generation, shapes: Shapes, reply: ChatReply | None
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
        try:
            await self._stream_events(request, req, gen, shapes, reply, resp)
        except ConnectionResetError:  # any write, the error event's and the last one's included
            return self.client_gone(request, resp)
        return resp

    async def _stream_events(
        self,
        request: web.Request,
        req: GenerationRequest,
        gen: Generation,
        shapes: Shapes,
        reply: ChatReply | None,
        resp: web.StreamResponse,
    ) -> None:
        usage = req.include_usage
        try:
            if req.chat:
                await resp.write(_sse(shapes.chunk(None, None, usage)))
            async with aclosing(gen.pieces()) as pieces:  # closed at once on a disconnect: the KV cache is freed
                async for piece in pieces:
                    if reply is None:
                        await resp.write(_sse(shapes.chunk(piece, None, usage)))
                    else:
                        for chunk in reply.feed(piece):
                            await resp.write(_sse(chunk))
            if reply is not None:
                for chunk in reply.end(gen.finish_reason):
                    await resp.write(_sse(chunk))
            else:
                final: Piece | None = Piece("", ()) if not req.chat else None
                await resp.write(_sse(shapes.chunk(final, gen.finish_reason, usage)))
            if usage:
                await resp.write(_sse(shapes.usage_chunk(gen.usage)))
        except AioExpertsError as exc:  # after the headers went out: an error event ends the stream
            err = api_error(exc)
            log.error("%s %s failed while streaming: %s", request.method, request.path, exc)
            await resp.write(_sse(err.body()))
        except asyncio.CancelledError:
            # cancelled at the shutdown deadline: the client is told why, and the response ends
            # properly (its last chunk), not cut off
            if not self.answer_shutdown_cancel():
                raise
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._end_stream(resp, _sse(_shutting_down().body())), 1.0)
            return
        await self._end_stream(resp)

    def client_gone(self, request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        """A streamed reply whose client left (a write found the connection reset): counted as
        cancelled and as status 499, and ended quietly (no traceback in the log)."""
        self.metrics.cancelled += 1
        request[CLIENT_GONE] = True
        log.debug("%s %s: the client left during the stream", request.method, request.path)
        return resp

    @staticmethod
    async def _end_stream(resp: web.StreamResponse, last: bytes = b"") -> None:
        await resp.write(last + b"data: [DONE]\n\n")
        await resp.write_eof()  # the terminating chunk

    def answer_shutdown_cancel(self) -> bool:
        """In a handler cancelled at the shutdown deadline (the server stopping): count the reply as
        cancelled and take the cancellation back, so the handler can tell the client why (True);
        any other cancellation goes on (False)."""
        if not self._stopping:
            return False
        self.metrics.cancelled += 1
        self._uncancel()
        return True

    @staticmethod
    def _uncancel() -> None:
        """Take back the cancellation of this task (the shutdown's): its handler ends with a response."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()

    # -- the other endpoints --------------------------------------------------------------------

    def _model_entry(self) -> dict[str, Any]:
        meta = {"n_ctx": self.model.n_ctx, "n_vocab": self.model.n_vocab, "architecture": self.model.hparams.arch}
        return {"id": self.name, "object": "model", "created": self._created, "owned_by": "aioexperts", "meta": meta}

    async def _models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self._model_entry()]})

    async def _model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: the model's entry, or 404 ``model_not_found`` for another id."""
        name = request.match_info["model"]
        if name != self.name:
            raise APIError(
                404,
                f"the model {name!r} does not exist here: this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )
        return _json_response(self._model_entry())

    async def _health(self, request: web.Request) -> web.Response:
        if self._stopping:
            response = _json_response({"status": "shutting down"}, 503)
            response.force_close()
            return response
        status, body = self.health.response()
        return _json_response(body, status)

    def _template_source(self) -> str | None:
        try:
            return self.model.chat_template.source
        except aioexperts.ChatTemplateError:
            return None

    async def _props(self, request: web.Request) -> web.Response:
        st = self.model.store.statistics()
        tok = self.model.tokenizer
        template = await self._in_text_worker(self._template_source)
        return _json_response(
            {
                "model": self.name,
                "model_path": self.model.path,
                "n_ctx": self.model.n_ctx,
                "n_vocab": self.model.n_vocab,
                "total_slots": self.options.parallel,
                "queue_size": self.options.queue_size,
                "chat_template": template,
                "bos_token": tok.piece(tok.bos_id).decode("utf-8", "replace") if tok.bos_id is not None else None,
                "eos_token": tok.piece(tok.eos_id).decode("utf-8", "replace") if tok.eos_id is not None else None,
                "slab": {
                    "slots": st.n_slots,
                    "slot_bytes": st.slot_bytes,
                    "bytes": st.n_slots * st.slot_bytes,
                    "backend": st.backend,
                    "direct_io": st.direct_io,
                },
                "prompt_cache": None
                if self.prompt_cache is None
                else {
                    "capacity_bytes": self.prompt_cache.capacity_bytes,
                    "sequence_bytes": self.prompt_cache.sequence_bytes,
                    "bytes": self.prompt_cache.bytes,
                    "entries": self.prompt_cache.entries,
                },
                "build_info": self.fingerprint,
            }
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        content, flags = parse_tokenize(await self._body(request))
        tok = self.model.tokenizer
        ids = await self._in_text_worker(
            lambda: tok.encode(content, add_special=flags["add_special"], parse_special=flags["parse_special"])
        )
        if flags["with_pieces"]:
            pieces = [{"id": t, "piece": tok.piece(t).decode("utf-8", "replace")} for t in ids]
            return _json_response({"tokens": pieces})
        return _json_response({"tokens": ids})

    async def _detokenize(self, request: web.Request) -> web.Response:
        ids = parse_detokenize(await self._body(request))
        tok = self.model.tokenizer
        bad = [t for t in ids if t >= tok.n_vocab]
        if bad:
            raise APIError(
                400,
                f"'tokens': token id {bad[0]} is out of range 0..{tok.n_vocab - 1}",
                param="tokens",
                code="invalid_value",
            )
        return _json_response({"content": await self._in_text_worker(lambda: tok.decode(ids))})

    async def _apply_template(self, request: web.Request) -> web.Response:
        req = parse_chat(await self._body(request))
        prompt = await self._in_text_worker(lambda: self._chat_prompt(req))
        return _json_response({"prompt": prompt.text})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.metrics.render(self.model, self.scheduler, self.prompt_cache)
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


def _modified(path: str) -> int:
    """The file's modification time in whole seconds (0 when it cannot be read)."""
    try:
        return int(os.stat(path).st_mtime)
    except OSError:
        return 0
