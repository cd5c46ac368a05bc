# Set-up is automatic: every target creates .venv and installs interlace into it first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
NPROC  ?= 2
TEST_WORKERS ?= 2

.PHONY: demo test test-slow lint format clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "interlace needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $@

## demo: train the default GPT on the built-in corpus on $(NPROC) ranks; report in runs/demo/
demo: $(BIN)/.installed
	$(BIN)/interlace train --nproc $(NPROC) --out runs/demo --overwrite

## test: lint, then the test suite on $(TEST_WORKERS) pytest-xdist workers (pytest exit code 5,
## "no tests collected", counts as failure)
test: $(BIN)/.installed
	$(BIN)/ruff check src tests
	$(BIN)/pytest -n $(TEST_WORKERS)

## test-slow: the tests marked slow (CI runs them after `make test`)
test-slow: $(BIN)/.installed
	$(BIN)/pytest -m slow

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

format: $(BIN)/.installed
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
