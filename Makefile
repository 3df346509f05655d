# Two commands do everything on a fresh machine:
#   make demo   train a small model with a functopt chain (installs into .venv first)
#   make test   run the test suite, the doctests, the linters and the strict docs build
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test unit test-deep lint docs clean

$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The suite, the linters and the docs build run side by side (the linters take about
# half a minute, beside pytest's eight); the output of each is printed when it is done.
test: $(STAMP)
	$(MAKE) --no-print-directory -j3 --output-sync=target unit lint docs

unit: $(STAMP)
	$(PY) -m pytest

test-deep: $(STAMP)
	HYPOTHESIS_PROFILE=deep $(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check functopt tests examples benchmarks
	$(PY) -m mypy

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir build/site

clean:
	rm -rf $(VENV) build site
