"""The user commands, each a ``main(argv) -> int`` behind a console script of ``pyproject.toml``.

- ``aioexperts-bench`` (:mod:`aioexperts.cli.bench`): read rates and the per-token pipeline on the
  built-in model or any GGUF; needs the ``bench`` extra (``rich``; ``--plot`` also ``matplotlib``,
  the ``plot`` extra).
- ``aioexperts-map`` (:mod:`aioexperts.cli.maptool`): a model's MoE layout; write and check
  WEEPF001 expert maps.
- ``aioexperts-trace`` (:mod:`aioexperts.cli.tracetool`): summarize a routing trace, replay it
  through simulated caches.

The commands use the public API only (and, for the bench, the bench machinery of
``aioexperts._bench``); the model runner's ``aioexperts-run`` and the server's ``aioexperts-serve``
go here too.
"""

__all__ = ()
