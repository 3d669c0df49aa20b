"""``aioexperts.serve``: an OpenAI-compatible HTTP server for a whole model (``aioexperts-serve``), which
also speaks Anthropic's Messages API (``/v1/messages``).

Needs the ``server`` extra (``pip install 'aioexperts[server]'``: aiohttp, and the ``text`` extra's
tokenizer and chat template); importing this package without aiohttp raises
:class:`~aioexperts.OptionalDependencyError` naming the extra. ``import aioexperts`` never imports it.

Example::

    import asyncio
    import aioexperts
    from aioexperts.serve import Server, ServerOptions
    from aioexperts.testing import builtin_model_path

    async def main() -> None:
        async with aioexperts.load(builtin_model_path(), n_ctx=4096) as model:
            server = Server(model, ServerOptions(port=0, parallel=4))   # port 0: a free one
            await server.start()
            print(f"listening on port {server.port}")
            await asyncio.sleep(1)            # until asked to stop
            await server.stop()               # in-flight requests finish, up to shutdown_timeout

    asyncio.run(main())

The package: :mod:`._app` (routes, middlewares, :class:`Server`), :mod:`._validate` (request
fields), :mod:`._tools` (the tool-calling fields), :mod:`._errors` (OpenAI error objects),
:mod:`._openai` (response shapes), :mod:`._prompt` (a chat prompt with tools and template
variables), :mod:`._replies` (a reply's content, reasoning and tool calls), :mod:`._anthropic`
(Anthropic's Messages API), :mod:`._generate` (one generation), :mod:`._scheduler` (slots and the
FIFO queue), :mod:`._metrics` (Prometheus text). docs/serving.md describes the endpoints and the metrics.
"""

from __future__ import annotations

from importlib.util import find_spec as _find_spec

from aioexperts import OptionalDependencyError as _OptionalDependencyError

try:
    _has_aiohttp = _find_spec("aiohttp") is not None
except ValueError:  # sys.modules["aiohttp"] is None: blocked
    _has_aiohttp = False
if not _has_aiohttp:
    raise _OptionalDependencyError(
        "aioexperts.serve needs aiohttp, which is not installed: pip install 'aioexperts[server]'"
    )

from ._app import DEFAULT_HOST, DEFAULT_PORT, Server, ServerOptions
from ._errors import APIError

__all__ = ("DEFAULT_HOST", "DEFAULT_PORT", "APIError", "Server", "ServerOptions")
