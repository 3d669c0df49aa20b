"""aioexperts-bench: the bench machinery behind ``aioexperts-bench`` and the scripts in ``bench/``.

A package of its own beside :mod:`aioexperts`, installed with it; not library API. It drives
aioexperts through the library's public names (``aioexperts``, :mod:`aioexperts.backends`,
:mod:`aioexperts.testing` for the built-in models and the memory cgroups) but for the few private
ones ``tests/test_import_rules.py`` lists with their reasons. ``aioexperts/cli/bench.py``,
``aioexperts/cli/bench_generate.py`` and the ``bench/`` scripts import the names below, from this
package only; its modules may change between releases. Needs the ``bench`` extra (``rich``).

- reads: :func:`run_read_bench` (:class:`ReadBenchConfig`, :data:`METHODS`), :func:`make_steps`,
  :func:`requests_in_flight`, :func:`drop_page_cache`, :func:`probe_host_cache`, the reads a run
  issued (:class:`ReadList`) and fio's replay of them (:func:`fio_path`, :func:`run_fio_replay`);
- the store and runner the benches drive: :func:`open_bench_store` (:class:`BenchOptions`),
  :func:`model_info` (:class:`ModelInfo`), :func:`cold_pass`, :func:`store_stats`;
- tokens: :func:`run_token_bench` (:class:`TokenBenchConfig`), :class:`OraclePredictor`;
- generate (``--mode generate``, aioexperts against llama.cpp under memory limits):
  :func:`run_generate_bench` (:class:`GenerateConfig`, :func:`parse_limit`, :data:`ENGINES`),
  :func:`text_report`, :func:`load_generate_results`, :func:`render_into`;
- timeline (``--mode timeline``, decode tokens under a memory limit, per layer): :func:`run_timeline_bench`
  (:class:`TimelineConfig`), :func:`timeline_report`, :func:`render_timeline_svg`;
- llama.cpp's own kernels as a baseline: :mod:`.ggml_baseline` (as a module: ``load``,
  ``GgmlLibrary``, ``GgmlMatVec``, ``check_agreement``), :class:`BaselineMismatchError`;
- sweeps and plots: :func:`run_sweeps`, :func:`write_plots`;
- results and tables: :func:`write_results` (:func:`write_text`), :func:`load_results`, :func:`evaluate_targets`,
  :func:`print_sections`, :func:`markdown`, :data:`SECTIONS`, the strict JSON writer
  (:func:`dump_json`, :func:`dumps_json`: NaN and inf become null);
- the loops and the clock: :func:`run_on_loop`, :func:`await_cost`, :class:`Clock`, :func:`spread`,
  :func:`rotated`, :func:`machine_facts`, :class:`Reporter`.

The built-in models (the bench model, the full model) and their cache are
:mod:`aioexperts.testing`'s: :func:`aioexperts.testing.ensure_bench_model`,
:func:`aioexperts.testing.ensure_full_model`, :func:`aioexperts.testing.cache_dir`.
"""

from aioexperts._format.model import split_shard_paths  # the shards a model path names (the commands' inputs)
from aioexperts._options import MAX_QUEUE_DEPTH, MIN_QUEUE_DEPTH

from . import ggml_baseline
from .cachestate import DROP_METHOD, drop_page_cache, probe_host_cache
from .fio import FioError, fio_path, run_fio_replay
from .generate import GenerateConfig, check_sidecar, parse_limit, run_generate_bench
from .generate_report import load_generate_results, render_into, text_report
from .generate_worker import DEFAULT_ENGINES, ENGINES
from .ggml_baseline import BaselineMismatchError
from .loops import LOOPS, await_cost
from .loops import run as run_on_loop
from .machine import cpu_vector_isa, kernel_facts, machine_facts, machine_label, source_commit
from .measure import GB, GIB, Clock, rotated, spread
from .plots import PLOT_NAMES, write_plots
from .progress import Reporter
from .readbench import DEFAULT_METHODS, METHODS, ReadBenchConfig, make_steps, requests_in_flight, run_read_bench
from .readlist import ReadList
from .report import SECTIONS, markdown, print_sections
from .results import (
    SCHEMA,
    UNITS,
    dump_json,
    dumps_json,
    evaluate_targets,
    json_safe,
    load_results,
    write_results,
    write_text,
)
from .store_adapter import BenchOptions, BenchStore, ModelInfo, cold_pass, model_info, open_bench_store, store_stats
from .sweep import run_sweeps
from .timeline import TIMELINE_SCHEMA, TimelineConfig, run_timeline_bench, timeline_report
from .timeline_svg import render_svg as render_timeline_svg
from .tokenbench import TARGET_OVERLAP, OraclePredictor, TokenBenchConfig, run_token_bench

__all__ = (
    "DEFAULT_ENGINES",
    "DEFAULT_METHODS",
    "DROP_METHOD",
    "ENGINES",
    "GB",
    "GIB",
    "LOOPS",
    "MAX_QUEUE_DEPTH",
    "METHODS",
    "MIN_QUEUE_DEPTH",
    "PLOT_NAMES",
    "SCHEMA",
    "SECTIONS",
    "TARGET_OVERLAP",
    "TIMELINE_SCHEMA",
    "UNITS",
    "BaselineMismatchError",
    "BenchOptions",
    "BenchStore",
    "Clock",
    "FioError",
    "GenerateConfig",
    "ModelInfo",
    "OraclePredictor",
    "ReadBenchConfig",
    "ReadList",
    "Reporter",
    "TimelineConfig",
    "TokenBenchConfig",
    "await_cost",
    "cold_pass",
    "drop_page_cache",
    "dump_json",
    "dumps_json",
    "evaluate_targets",
    "fio_path",
    "ggml_baseline",
    "json_safe",
    "kernel_facts",
    "load_generate_results",
    "load_results",
    "machine_facts",
    "machine_label",
    "cpu_vector_isa",
    "make_steps",
    "markdown",
    "model_info",
    "open_bench_store",
    "parse_limit",
    "check_sidecar",
    "print_sections",
    "probe_host_cache",
    "render_into",
    "render_timeline_svg",
    "requests_in_flight",
    "rotated",
    "run_fio_replay",
    "source_commit",
    "run_generate_bench",
    "run_on_loop",
    "run_read_bench",
    "run_sweeps",
    "run_timeline_bench",
    "run_token_bench",
    "split_shard_paths",
    "spread",
    "store_stats",
    "text_report",
    "timeline_report",
    "write_plots",
    "write_results",
    "write_text",
)
