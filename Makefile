# One command each: `make bench` sets everything up and runs the benchmark on the built-in model;
# `make test` sets up and runs the tests. Both create ./.venv from this project's own files.
#
#   make bench                      # all benches, 5 rounds, writes bench-results.json (about 3-8 min, depending on the disk)
#   make bench BENCH_ARGS="--rounds 11"   # more rounds, any aioexperts-bench option
#   make bench-plots                # the same plus the depth/size sweeps and PNGs in docs/img
#   make render RESULTS=docs/results/FILE.json   # the tables of README.md and docs/*.md from the results files
#   make setup                      # only create ./.venv (aioexperts with the test extras)

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BENCH_ARGS ?=
RESULTS ?= bench-results.json

.PHONY: setup bench bench-plots render test clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $@

$(BIN)/.plot-installed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test,bench,plot]'
	touch $@

setup: $(BIN)/.installed
	@echo "ready: $(BIN)/python, $(BIN)/aioexperts-bench, $(BIN)/aioexperts-map, $(BIN)/aioexperts-trace"

bench: $(BIN)/.installed
	$(BIN)/aioexperts-bench --out bench-results.json $(BENCH_ARGS)

bench-plots: $(BIN)/.plot-installed
	$(BIN)/aioexperts-bench --out bench-results.json --plot docs/img $(BENCH_ARGS)

render: $(BIN)/.installed
	$(BIN)/python bench/render.py $(RESULTS) --write README.md docs/bench.md docs/executor.md --extra

test: $(BIN)/.installed
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
