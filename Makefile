# Two commands do everything on a fresh machine:
#   make demo   train a small model with a functopt chain (installs into .venv first)
#   make test   run the test suite, the doctests, the linters and the strict docs build
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test unit test-deep lint docs clean gpu-wheels

$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The suite and the linters run side by side (the linters take about half a minute); the
# output of each is printed when it is done. The strict docs build is a test of the suite
# (tests/test_docs.py), so `make test` builds the site once.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target unit lint

# Two worker processes, one per core here; a worker takes a whole test file at a time, so
# that a file's module-scoped fixtures (a pool of ranks, a built site) are set up once.
# The timed laws (marked serial) run after them, in one process with no worker beside it.
unit: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -m 'not slow and not serial'
	$(PY) -m pytest -m 'serial and not slow'

test-deep: $(STAMP)
	HYPOTHESIS_PROFILE=deep $(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check functopt tests examples benchmarks
	$(PY) -m mypy

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir build/site

clean:
	rm -rf $(VENV) build site

# The wheels the GPU machine lacks (it has PyTorch, pytest and hypothesis, not optree), for
# benchmarks/gpu_check.sh: its Python is 3.12 on x86-64.
gpu-wheels: $(STAMP)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl \
	  optree==$$($(PY) -c "import optree; print(optree.__version__)")
