# vf-sandbox: install, build images, lint, typecheck, test, demo, bench.
# `make test` is what CI runs (.ci/run). Everything is non-interactive.
#
#   make test                    everything CI does: venv + deps, Docker engine, images, lint, types, pytest
#   make test PYTEST_ARGS='-k ssh -x' PYTEST_WORKERS=3
#   make check                   the inner loop (minutes): lint, types, the tests that need no engine
#   make images FORCE=1          rebuild the base image and all images/<name>/ images from scratch
#   make demo | bench | lint | typecheck | floors | clean | distclean   (demo: no dev tools; DEMO_EXTRAS=all)

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
# Two install sets, one stamp each: the dev set (`.[test]` + tests/plugins) for test/lint/typecheck,
# the run set (the project with DEMO_EXTRAS, nothing else) for demo. The dev set contains the run set.
STAMP := $(VENV)/.installed
DEMO_EXTRAS ?= docker,ssh
comma := ,
RUN_STAMP := $(VENV)/.installed-run-$(subst $(comma),-,$(DEMO_EXTRAS))
# pip's own output is the progress; setuptools' note on every editable install (folders named
# like a package may shadow it) is filtered as the one expected warning.
PIP_INSTALL := PYTHONWARNINGS='ignore:Editable installation' $(VENV_PY) -m pip install
step = echo "==> $(1)"
PLUGIN_PYPROJECTS := $(wildcard tests/plugins/*/pyproject.toml)
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(PLUGIN_PYPROJECTS))
SRC_DIRS := runtimes harnesses placement
LINT_DIRS := $(SRC_DIRS) tests benchmarks
IMAGES_FLAGS := $(if $(filter 1 yes true,$(FORCE)),--force,)
PYTEST_ARGS ?=
# The extras that bring torch ([trl], and [all] through it) get it pinned to the CPU build on disk.
TORCH_PIN := $(if $(filter all trl,$(subst $(comma), ,$(DEMO_EXTRAS))),'torch==2.13.0',)

.PHONY: help venv install install-run engine compose bench-compose images shellcheck stress-ng floors lint typecheck prepare test check demo bench clean distclean

help:
	@sed -n '1,7s/^# \{0,1\}//p' $(firstword $(MAKEFILE_LIST))

# --- Python environment ----------------------------------------------------------------------------------
venv: $(VENV_PY)

$(VENV_PY):
	@$(call step,creating $(VENV) with $(PYTHON))
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
	$(call step,upgrading pip)
	$(PIP_INSTALL) --upgrade pip

install: $(STAMP)

install-run: $(RUN_STAMP)

# Re-run when the project's or a test plugin's pyproject.toml changes.
$(STAMP): pyproject.toml $(PLUGIN_PYPROJECTS) | $(VENV_PY)
	@$(call step,installing the dev set: vf-sandbox[test] + the test plugins under tests/plugins)
	# torch pinned: pip takes 2.13.0's CPU build from this machine's disk (a bare `torch`, which
	# the [trl] extra names, would pull several GB of CUDA wheels); the extra then finds it satisfied.
	$(PIP_INSTALL) 'torch==2.13.0' -e '.[test]' $(foreach d,$(PLUGIN_DIRS),-e ./$(d))
	touch $@

# An up-to-date dev set already holds the run set: then nothing is installed.
$(RUN_STAMP): pyproject.toml | $(VENV_PY)
	@if $(MAKE) --no-print-directory -q $(STAMP); then
	  $(call step,the dev set in $(VENV) already holds vf-sandbox[$(DEMO_EXTRAS)])
	else
	  $(call step,installing vf-sandbox[$(DEMO_EXTRAS)] into $(VENV))
	  $(PIP_INSTALL) $(TORCH_PIN) -e '.[$(DEMO_EXTRAS)]'
	fi
	touch $@

# --- Docker engine and offline images --------------------------------------------------------------------
# engine also installs Debian's docker-registry (as root) when missing: the loopback registry
# of the pull-policy tests (tests/docker/test_pull.py).
# Ordered after the other apt-get installs (shellcheck, stress-ng): under `make -j` only one
# apt-get runs at a time.
engine: | shellcheck stress-ng
	bash images/engine.sh
	if ! command -v docker-registry >/dev/null; then
	  if [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
	    apt-get install -y -q --no-install-recommends docker-registry </dev/null \
	      || { apt-get update -q </dev/null && apt-get install -y -q --no-install-recommends docker-registry </dev/null; }
	  else
	    echo "engine: docker-registry is missing (apt-get install docker-registry); the pull tests need it" >&2
	  fi
	fi

# compose: the Docker Compose v2 CLI plugin (`docker compose`), which inspect_ai's built-in docker
# sandbox (the baseline of the benchmark's inspect section) drives; Debian trixie's docker-compose
# package, fetched from the host's mirror with a private apt state (images/compose-plugin.sh).
# Only `make bench` needs it (through bench-compose: if it fails the benchmark still runs and
# those rows say so); `make test` does not.
compose: engine
	bash images/compose-plugin.sh

bench-compose: engine
	bash images/compose-plugin.sh || echo "bench: docker compose v2 could not be installed; the inspect docker-sandbox rows will say so" >&2

images: engine
	bash images/build-base.sh $(IMAGES_FLAGS)
	bash images/build-images.sh $(IMAGES_FLAGS)

# --- checks ------------------------------------------------------------------------------------------------
# The sh programs run inside sandboxes (runtimes/**/*.sh) are linted as POSIX sh, the build scripts
# (images/*.sh) as bash; shellcheck comes from Debian's archive when it is missing (as root; else
# install it yourself).
shellcheck:
	if ! command -v shellcheck >/dev/null; then
	  if [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
	    apt-get install -y -q --no-install-recommends shellcheck </dev/null \
	      || { apt-get update -q </dev/null && apt-get install -y -q --no-install-recommends shellcheck </dev/null; }
	  else
	    echo "lint: shellcheck is missing (apt-get install shellcheck)" >&2; exit 1
	  fi
	fi

# stress-ng: the background load of the soak (tests/reliability/test_soak.py), from Debian's
# archive when it is missing (as root; else install it yourself).
stress-ng: | shellcheck
	if ! command -v stress-ng >/dev/null; then
	  if [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
	    apt-get install -y -q --no-install-recommends stress-ng </dev/null \
	      || { apt-get update -q </dev/null && apt-get install -y -q --no-install-recommends stress-ng </dev/null; }
	  else
	    echo "test: stress-ng is missing (apt-get install stress-ng); the soak needs it" >&2; exit 1
	  fi
	fi

# deps: deptry over runtimes, harnesses and placement ([tool.deptry] in pyproject.toml, each
# ignore with its reason): an import no dependency declares (sniffio, once), or a declared
# dependency nothing imports, fails. lint runs it too.
.PHONY: deps
deps: install
	$(VENV)/bin/deptry .

lint: install shellcheck
	rc=0
	shellcheck -s sh $$(find runtimes -name '*.sh' | sort) || rc=1
	shellcheck -x images/*.sh || rc=1
	$(VENV)/bin/ruff check $(wildcard $(LINT_DIRS)) || rc=1
	$(VENV)/bin/ruff format --check $(wildcard $(LINT_DIRS)) || rc=1
	$(VENV)/bin/deptry . || rc=1
	exit $$rc

typecheck: install
	$(VENV)/bin/mypy $(SRC_DIRS)

# The declared dependency floors, installed and run: tests/floors.txt pins each floor of
# pyproject.toml (tests/test_floors.py keeps the two in step) into a venv of its own, the project
# goes in without dependencies, and these tests run there: the core on every path (subprocess,
# both event loops), docker and paramiko at their floors, the model proxy (httpx, aiohttp).
FLOORS_VENV := .build/floors-venv
FLOORS_STAMP := $(FLOORS_VENV)/.installed
FLOORS_TESTS := tests/conformance/test_subprocess.py tests/ssh/test_runtime.py \
  tests/docker/test_exec.py tests/harnesses/test_proxy.py tests/harnesses/test_routes.py

$(FLOORS_STAMP): pyproject.toml tests/floors.txt | $(VENV_PY)
	@$(call step,installing the declared floors (tests/floors.txt) into $(FLOORS_VENV))
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install -q -r tests/floors.txt
	PYTHONWARNINGS='ignore:Editable installation' $(FLOORS_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

floors: $(FLOORS_STAMP) images
	@$(call step,the suite's core at the declared floors)
	$(FLOORS_VENV)/bin/pytest -q -p no:cacheprovider $(FLOORS_TESTS)

# Everything pytest needs, side by side (`make -j`): the dev set installs while the engine
# starts and the images build; lint, types and the floors follow each as soon as its inputs are
# there. Each step's output is printed whole when it ends (--output-sync).
PREPARE_JOBS ?= 4
prepare:
	$(MAKE) --no-print-directory -j$(PREPARE_JOBS) --output-sync=target install images lint typecheck stress-ng floors

# pytest in two phases (tests/parallel.py, docs/reliability.md "How the suite runs"): every test
# but the serial ones on PYTEST_WORKERS workers (pytest-xdist; a worker takes a whole file or
# class, and the tests that act on a whole backend share one worker), then the serial ones alone.
# pytest's own exit code is each phase's result: 5 (no tests collected) fails, unless
# PYTEST_ARGS narrowed the run and the other phase ran tests.
PYTEST_WORKERS ?= 3
PYTEST := $(VENV)/bin/pytest

test: prepare
	@$(call step,pytest side by side on $(PYTEST_WORKERS) workers)
	rc1=0; $(PYTEST) --phase=parallel -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) || rc1=$$?
	$(call step,pytest: the serial tests alone)
	rc2=0; $(PYTEST) --phase=serial $(PYTEST_ARGS) || rc2=$$?
	echo "pytest exit codes: side by side $$rc1, alone $$rc2"
	if [ -n "$(strip $(PYTEST_ARGS))" ]; then
	  if [ $$rc1 -eq 5 ] && [ $$rc2 -eq 0 ]; then rc1=0; fi
	  if [ $$rc2 -eq 5 ] && [ $$rc1 -eq 0 ]; then rc2=0; fi
	fi
	[ $$rc1 -eq 0 ] && [ $$rc2 -eq 0 ]

# The inner loop between commits (not CI's): lint, types, and the tests that need no engine,
# no sshd and no cluster, side by side; not the install proofs of tests/install (a venv per
# extra and a bare clone's `make demo`: a fifth of the time). CI runs `make test`.
CHECK_MARKERS := not docker and not ssh and not ray and not slow and not modal_live
check:
	$(MAKE) --no-print-directory -j$(PREPARE_JOBS) --output-sync=target lint typecheck
	$(PYTEST) -n $(PYTEST_WORKERS) --dist loadgroup -m '$(CHECK_MARKERS)' --ignore=tests/install $(PYTEST_ARGS)

# --- demo and benchmarks -----------------------------------------------------------------------------------
# The main job: judge the example rollout on the subprocess runtime. Offline, the judges'
# model replies come from examples/scripted.json (labelled SCRIPTED in the output); with
# OPENAI_BASE_URL set, the same code path calls that endpoint instead.
demo: install-run
	@$(call step,judging examples/rollout with examples/judges.yaml on the subprocess runtime)
	$(VENV)/bin/vf-sandbox judge examples/rollout --judges examples/judges.yaml \
	  --scripted examples/scripted.json --out agent-runs.json --force

# The SWE-ReX baseline of the shell-session rows: its client in a venv of its own (kept apart from
# the project's pins; only `make bench` makes it), its server in vf-sandbox/swerex (images/swerex,
# same version). swe-rex does not declare aiohttp, which its RemoteRuntime imports. If the install
# fails the benchmark still runs and its SWE-ReX row says what is missing.
SWEREX_VERSION := 1.4.0
SWEREX_VENV := .build/swerex-venv
SWEREX_STAMP := $(SWEREX_VENV)/.installed-$(SWEREX_VERSION)

$(SWEREX_STAMP):
	@$(call step,installing swe-rex $(SWEREX_VERSION) into $(SWEREX_VENV) for the benchmark's SWE-ReX client)
	rm -rf $(SWEREX_VENV)
	if $(PYTHON) -m venv $(SWEREX_VENV) \
	    && $(SWEREX_VENV)/bin/python -m pip install -q 'swe-rex==$(SWEREX_VERSION)' aiohttp; then
	  touch $@
	else
	  echo "bench: swe-rex could not be installed into $(SWEREX_VENV); its rows will say so" >&2
	  rm -rf $(SWEREX_VENV)
	fi

bench: install images $(SWEREX_STAMP) bench-compose
	bash images/build-images.sh $(IMAGES_FLAGS) swerex || echo "bench: vf-sandbox/swerex could not be built; its rows will say so" >&2
	$(VENV)/bin/python -m benchmarks --swerex-python $(SWEREX_VENV)/bin/python

# --- housekeeping --------------------------------------------------------------------------------------------
clean:
	rm -f $(VENV)/.installed*
	rm -rf .build

distclean: clean
	rm -rf $(VENV)
