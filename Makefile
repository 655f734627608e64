# vf-sandbox: install, build images, lint, typecheck, test, demo, bench.
# `make test` is what CI runs (.ci/run). Everything is non-interactive.
#
#   make test                    everything CI does: venv + deps, Docker engine, images, lint, types, pytest
#   make test PYTEST_ARGS='-k ssh -x'
#   make images FORCE=1          rebuild the base image and all images/<name>/ images from scratch
#   make demo | bench | lint | typecheck | clean | distclean

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.ONESHELL:
.DELETE_ON_ERROR:
MAKEFLAGS += --no-builtin-rules
.DEFAULT_GOAL := help

# testcontainers' Ryuk reaper container cannot be pulled here; the project sweeps its own labels.
export TESTCONTAINERS_RYUK_DISABLED := true
export DEBIAN_FRONTEND := noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK ?= 1

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PLUGIN_PYPROJECTS := $(wildcard tests/plugins/*/pyproject.toml)
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(PLUGIN_PYPROJECTS))
SRC_DIRS := runtimes harnesses placement
LINT_DIRS := $(SRC_DIRS) tests benchmarks
IMAGES_FLAGS := $(if $(filter 1 yes true,$(FORCE)),--force,)
PYTEST_ARGS ?=

.PHONY: help venv install engine images shellcheck lint typecheck test demo bench clean distclean

help:
	@sed -n '1,7s/^# \{0,1\}//p' $(firstword $(MAKEFILE_LIST))

# --- Python environment ----------------------------------------------------------------------------------
venv: $(VENV_PY)

$(VENV_PY):
	if ! $(PYTHON) -m venv $(VENV); then
	  rm -rf $(VENV)
	  if [ "$(PYTHON)" = python3 ] && [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
	    echo "venv: '$(PYTHON) -m venv' failed; installing python3 + python3-venv with apt-get"
	    apt-get update -q </dev/null
	    apt-get install -y -q --no-install-recommends python3 python3-venv </dev/null
	    $(PYTHON) -m venv $(VENV)
	  else
	    echo "venv: '$(PYTHON) -m venv' failed (install python3-venv, or pass PYTHON=...)" >&2; exit 1
	  fi
	fi
	$(VENV_PY) -m pip install --quiet --upgrade pip

install: $(STAMP)

# Re-run when the project's or a test plugin's pyproject.toml changes.
$(STAMP): pyproject.toml $(PLUGIN_PYPROJECTS) | $(VENV_PY)
	$(VENV_PY) -m pip install --quiet -e '.[test]' $(foreach d,$(PLUGIN_DIRS),-e ./$(d))
	touch $@

# --- Docker engine and offline images --------------------------------------------------------------------
engine:
	bash images/engine.sh

images: engine
	bash images/build-base.sh $(IMAGES_FLAGS)
	bash images/build-images.sh $(IMAGES_FLAGS)

# --- checks ------------------------------------------------------------------------------------------------
# The sh programs run inside sandboxes (runtimes/**/*.sh) are linted as POSIX sh; shellcheck comes
# from Debian's archive when it is missing (as root; else install it yourself).
shellcheck:
	if ! command -v shellcheck >/dev/null; then
	  if [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
	    apt-get install -y -q --no-install-recommends shellcheck </dev/null \
	      || { apt-get update -q </dev/null && apt-get install -y -q --no-install-recommends shellcheck </dev/null; }
	  else
	    echo "lint: shellcheck is missing (apt-get install shellcheck)" >&2; exit 1
	  fi
	fi

lint: install shellcheck
	rc=0
	shellcheck -s sh $$(find runtimes -name '*.sh' | sort) || rc=1
	$(VENV)/bin/ruff check $(wildcard $(LINT_DIRS)) || rc=1
	$(VENV)/bin/ruff format --check $(wildcard $(LINT_DIRS)) || rc=1
	exit $$rc

typecheck: install
	$(VENV)/bin/mypy $(SRC_DIRS)

# pytest's own exit code is the result (5 = no tests collected fails too).
test: install images lint typecheck
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# --- demo and benchmarks -----------------------------------------------------------------------------------
# The main job: judge the example rollout on the subprocess runtime. Offline, the judges'
# model replies come from examples/scripted.json (labelled SCRIPTED in the output); with
# OPENAI_BASE_URL set, the same code path calls that endpoint instead.
demo: install
	$(VENV)/bin/vf-sandbox judge examples/rollout --judges examples/judges.yaml \
	  --scripted examples/scripted.json --out agent-runs.json

bench: install images
	$(VENV)/bin/python -m benchmarks

# --- housekeeping --------------------------------------------------------------------------------------------
clean:
	rm -f $(STAMP)
	rm -rf .build

distclean: clean
	rm -rf $(VENV)
