# One command each: `make bench` sets everything up and runs the benchmark on the built-in model;
# `make test` sets up and runs the tests. Both create ./.venv from this project's own files.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: bench test clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

bench: $(BIN)/.installed
	$(BIN)/aioexperts-bench

test: $(BIN)/.installed
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
