"""The user commands, each a ``main(argv) -> int`` behind a console script of ``pyproject.toml``.

- ``aioexperts-bench`` (:mod:`aioexperts.cli.bench`): read rates and the per-token pipeline on the
  built-in model or any GGUF; needs the ``bench`` extra (``rich``; ``--plot`` also ``matplotlib``,
  the ``plot`` extra).
- ``aioexperts-map`` (:mod:`aioexperts.cli.maptool`): a model's MoE layout; write and check
  WEEPF001 expert maps.
- ``aioexperts-trace`` (:mod:`aioexperts.cli.tracetool`): summarize a routing trace, replay it
  through simulated caches.

- ``aioexperts-run`` (:mod:`aioexperts.cli.run`) and ``aioexperts-serve`` (:mod:`aioexperts.cli.serve`):
  generate text and serve it over HTTP; without a model, the built-in full model of
  :mod:`aioexperts.testing`.

The commands use the public API only; the bench's two (:mod:`aioexperts.cli.bench`,
:mod:`aioexperts.cli.bench_generate`) also drive the bench package ``aioexperts_bench`` beside
``aioexperts``, which no other module of ``aioexperts`` imports.
"""

__all__ = ()
