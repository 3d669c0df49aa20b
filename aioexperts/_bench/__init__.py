"""The bench machinery behind ``aioexperts-bench`` and the scripts in ``bench/``.

Not library API: the read-rate and per-token benches, the built-in model's cache, the results file
and its tables. ``aioexperts/cli/bench.py`` and the ``bench/`` scripts import the names below, from
this package only; its modules may change between releases. Needs the ``bench`` extra (``rich``).

- reads: :func:`run_read_bench` (:class:`ReadBenchConfig`, :data:`METHODS`), :func:`make_steps`,
  :func:`requests_in_flight`, :func:`drop_page_cache`, :func:`probe_host_cache`;
- tokens: :func:`run_token_bench` (:class:`TokenBenchConfig`), :class:`OraclePredictor`;
- sweeps and plots: :func:`run_sweeps`, :func:`write_plots`;
- the built-in model: :func:`ensure_bench_model`, :func:`bench_model_path`, :func:`cache_dir`;
- results and tables: :func:`write_results`, :func:`load_results`, :func:`evaluate_targets`,
  :func:`print_sections`, :func:`markdown`, :data:`SECTIONS`;
- the loops and the clock: :func:`run_on_loop`, :func:`await_cost`, :class:`Clock`, :func:`spread`,
  :func:`rotated`, :func:`machine_facts`, :class:`Reporter`;
- :mod:`.store_adapter` (as a module): the store and runner the benches drive, and their counters.
"""

from .._format.model import split_shard_paths  # the shards a model path names (the commands' inputs)
from .._options import MAX_QUEUE_DEPTH, MIN_QUEUE_DEPTH
from .cachestate import DROP_METHOD, drop_page_cache, probe_host_cache
from .loops import LOOPS, await_cost
from .loops import run as run_on_loop
from .machine import kernel_facts, machine_facts, machine_label
from .measure import GB, GIB, Clock, rotated, spread
from .model_cache import bench_model_path, cache_dir, ensure_bench_model
from .plots import PLOT_NAMES, write_plots
from .progress import Reporter
from .readbench import DEFAULT_METHODS, METHODS, ReadBenchConfig, make_steps, requests_in_flight, run_read_bench
from .report import SECTIONS, markdown, print_sections
from .results import SCHEMA, UNITS, dump_json, dumps_json, evaluate_targets, json_safe, load_results, write_results
from .sweep import run_sweeps
from .tokenbench import TARGET_OVERLAP, OraclePredictor, TokenBenchConfig, run_token_bench

__all__ = (
    "DEFAULT_METHODS",
    "DROP_METHOD",
    "GB",
    "GIB",
    "LOOPS",
    "MAX_QUEUE_DEPTH",
    "METHODS",
    "MIN_QUEUE_DEPTH",
    "SCHEMA",
    "SECTIONS",
    "TARGET_OVERLAP",
    "UNITS",
    "Clock",
    "PLOT_NAMES",
    "OraclePredictor",
    "ReadBenchConfig",
    "Reporter",
    "TokenBenchConfig",
    "await_cost",
    "bench_model_path",
    "cache_dir",
    "drop_page_cache",
    "dump_json",
    "dumps_json",
    "ensure_bench_model",
    "evaluate_targets",
    "json_safe",
    "kernel_facts",
    "load_results",
    "machine_facts",
    "machine_label",
    "make_steps",
    "markdown",
    "print_sections",
    "probe_host_cache",
    "requests_in_flight",
    "rotated",
    "run_on_loop",
    "run_read_bench",
    "run_sweeps",
    "run_token_bench",
    "split_shard_paths",
    "spread",
    "write_plots",
    "write_results",
)
