# Fresh machine with Python 3.11+:  `make run` (default evaluation) and `make test` (lint + tests).
# Both create .venv on first use; a stamp file re-installs only when setup.cfg/pyproject.toml change.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
# The default `make run` workload (README, "How long it takes", gives its timing on a
# 2-core CPU); `make run RUN_ARGS=` runs the binary's own defaults (24 prompts, 128 new
# tokens; 3 repeats on a GPU).
RUN_ARGS ?= --num_prompts=6 --max_new_tokens=48 --repeats=2

.PHONY: run test clean-venv

run: $(VENV)/.installed-run
	$(BIN)/python -m experiments.evaluate $(RUN_ARGS) $(ARGS)

test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/pytest -q

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "specjax needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-run: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/python -m pip install -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/python -m pip install -e '.[test]'
	touch $@ $(VENV)/.installed-run

clean-venv:
	rm -rf $(VENV)
