# One command each: `make run` sets up and generates text with the built-in full model; `make bench`
# sets everything up and runs the benchmark on the built-in model; `make test` sets up, runs `make lint`
# (a lint failure fails it) and then the tests (the core suite, then the Ray tests of aioexperts.distributed
# in a second pass). All create ./.venv from this project's own files.
#
#   make run                        # writes the built-in full model once (2.9 GB), streams text, prints the stats
#   make run RUN_ARGS='-p "Hi" -n 32 --temp 0'   # any aioexperts-run option (MODEL.gguf too)
#   make bench                      # all benches, 5 rounds, writes bench-results.json (about 3-8 min, depending on the disk)
#   make bench BENCH_ARGS="--rounds 11"   # more rounds, any aioexperts-bench option
#   make bench-plots                # the same plus the depth/size sweeps and PNGs in docs/img
#   make render RESULTS=docs/results/FILE.json   # the tables of README.md and docs/*.md from the results files
#   make setup                      # only create ./.venv (aioexperts and its bench package aioexperts_bench, with the test and bench extras)
#   make lint                       # ruff check, ruff format --check, mypy --strict (pyproject's settings)

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BENCH_ARGS ?=
RUN_ARGS ?= -p "Once upon a time" -n 64
RESULTS ?= bench-results.json

.PHONY: setup run bench bench-plots render lint test clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --config-settings editable_mode=compat -e '.[test,bench]'
	touch $@

$(BIN)/.text-installed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet --config-settings editable_mode=compat -e '.[test,text]'
	touch $@

# the dev extra: ruff and mypy at the versions pyproject.toml pins as their minimum
$(BIN)/.dev-installed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet --config-settings editable_mode=compat -e '.[test,bench,dev]'
	touch $@

$(BIN)/.ray-installed: $(BIN)/.dev-installed
	$(BIN)/python -m pip install --quiet --config-settings editable_mode=compat -e '.[test,bench,ray,dev]'
	touch $@

$(BIN)/.plot-installed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet --config-settings editable_mode=compat -e '.[test,bench,plot]'
	touch $@

setup: $(BIN)/.installed
	@echo "ready: $(BIN)/python, $(BIN)/aioexperts-run, $(BIN)/aioexperts-bench, $(BIN)/aioexperts-map, $(BIN)/aioexperts-trace, $(BIN)/aioexperts-serve, $(BIN)/aioexperts-tier"

run: $(BIN)/.text-installed
	$(BIN)/aioexperts-run $(RUN_ARGS)

bench: $(BIN)/.installed
	$(BIN)/aioexperts-bench --out bench-results.json $(BENCH_ARGS)

bench-plots: $(BIN)/.plot-installed
	$(BIN)/aioexperts-bench --out bench-results.json --plot docs/img $(BENCH_ARGS)

render: $(BIN)/.installed
	$(BIN)/python bench/render.py $(RESULTS) --write README.md docs/bench.md docs/executor.md --extra

# the habits CI keeps: ruff's lint rules and format, mypy --strict on the package (the numba kernels
# excluded by name); all configured in pyproject.toml
lint: $(BIN)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# lint first (a failure stops here), then two passes: the core suite without Ray, then the expert-shard
# tests on a local Ray cluster
test: lint $(BIN)/.ray-installed
	$(BIN)/python -m pytest -m "not ray"
	$(BIN)/python -m pytest -m ray tests/distributed tests/test_docs_examples.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
