# The two README commands. Each creates/uses .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test bench lint

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	# torch first and pinned: this CPU build lies on the local disk (other versions pull GBs of CUDA).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"

demo: install
	$(BIN)/python recipes/benchmark_attention.py --quick

test: install
	$(BIN)/ruff check hf_polyattn tests recipes
	$(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/python recipes/benchmark_attention.py

lint: install
	$(BIN)/ruff check hf_polyattn tests recipes
