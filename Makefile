# The two commands from the README:
#   make book   set up .venv and build the HTML book into _build/html (no warnings allowed)
#   make test   set up .venv and run the whole test suite: unit tests + nbval on every chapter
# Helpers: make execute (re-run notebooks in place, refreshing committed outputs), make lock, make clean.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Use the data copies beside the checkout when they exist (CI, offline machines); otherwise
# lib.data and tiktoken download and cache what they need, checksum-verified.
SHARED := $(abspath ../shared)
ifneq ($(wildcard $(SHARED)/data/tinyshakespeare.txt),)
export GPTBOOK_DATA ?= $(SHARED)/data
endif
ifneq ($(wildcard $(SHARED)/tiktoken_cache),)
export TIKTOKEN_CACHE_DIR ?= $(SHARED)/tiktoken_cache
endif
# The kernels of `make execute` run with these; pytest sets the same in conftest.py.
export MPLBACKEND := Agg
export PYTHONHASHSEED := 0

NOTEBOOKS := $(sort $(wildcard chapters/*.ipynb))

.PHONY: book test unit nbval execute lock clean venv devices

venv: $(STAMP)

$(STAMP): requirements-lock.txt requirements.txt requirements-dev.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-lock.txt
	@touch $@

# _ext/book_sphinx.py fetches MathJax when the build starts, so this is a plain
# `jupyter-book build .` plus strictness (warnings are errors) and tools/check_build.py.
book: $(STAMP)
	$(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going
	$(BIN)/python tools/check_build.py _build/html
	@echo "Book built: open _build/html/index.html"

# Unit tests in two workers (small tensors, one thread each); the chapters one at a time: two
# notebooks at once on CI's two cores, each with torch's two threads, oversubscribe the CPU badly
# enough that a training cell ran past nbval's 600 s cell timeout. pytest.ini and conftest.py hold
# the nbval options and the kernels' environment, so `pytest --nbval chapters/` runs the same way.
test: $(STAMP)
	$(BIN)/python tools/warm_model_cache.py
	$(BIN)/python -m pytest -n 2 tests
	$(BIN)/python -m pytest --nbval $(NOTEBOOKS)

unit: $(STAMP)
	$(BIN)/python -m pytest tests

nbval: $(STAMP)
	$(BIN)/python -m pytest --nbval $(or $(NB),$(NOTEBOOKS))

# Chapter 12a runs on emulated CUDA (tests/fakecuda): any device or dtype error fails
# (tools/fake_cuda_chapters.py; .ci/run runs it after the tests), its training 20 steps instead of
# 100 (the device path is the same at every step). 11 and A1 also use env.device
# and are not run here, for the CI budget.
devices: $(STAMP)
	$(BIN)/python tools/fake_cuda_chapters.py

# Re-execute notebooks in place so their committed outputs match the code (NB=chapters/01_tokens.ipynb for one).
execute: $(STAMP)
	$(BIN)/python tools/execute_notebooks.py $(or $(NB),$(NOTEBOOKS))

lock:
	{ echo "# Exact versions the Makefile installs (CI and local builds). Regenerate with 'make lock'."; \
	  $(BIN)/python -m pip freeze --exclude-editable | sed 's/^torch==.*/torch==2.13.0/' | sort -f; } > requirements-lock.txt.tmp
	mv requirements-lock.txt.tmp requirements-lock.txt

clean:
	rm -rf _build
