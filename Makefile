# Two entry points that work on a fresh Linux machine (Python >= 3.10 with venv):
#   make demo   -- create .venv, install zero2all and its runtime dependencies only, run the whole pipeline on the
#                  embedded stdlib corpus
#   make test   -- create .venv, install with test extras, run ruff, the docs build and the test suite
#   make docs   -- build the documentation site into site/ (mkdocs build --strict: a broken link fails)
# Two stamps: $(VENV)/.runtime (torch + `pip install -e .`: what the demo needs) and $(VENV)/.installed (that plus
# the test extras: pytest, triton, lm-eval, peft, openai, mkdocs, ruff, the server's starlette / uvicorn, ...).
# `make test` after `make demo` adds the extras to the same venv.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch is installed first and on its own so that a machine with a preferred local wheel (CPU-only CI) or a
# CUDA build can choose it: `make test TORCH_SPEC='torch==2.11.0'`.
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= runs/demo
DEMO_ARGS ?=

.PHONY: demo test lint docs install clean

$(VENV)/.runtime: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" || $(PY) -m pip install -q "torch>=2.5"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.runtime pyproject.toml Makefile
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.runtime
	$(VENV)/bin/z2all demo --out $(DEMO_OUT) $(DEMO_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict --quiet

test: lint docs
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=15 tests

clean:
	rm -rf $(VENV) runs .pytest_cache site
