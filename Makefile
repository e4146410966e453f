# Set-up is idempotent: the venv is (re)built only when pyproject.toml changes.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)  ## the main job: one certified decode step on random data, dense vs naive vs certified
	$(VENV)/bin/certkv demo

lint: $(STAMP)
	$(VENV)/bin/ruff check certkv tests scripts

test: $(STAMP) lint  ## lint + the whole test suite
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
