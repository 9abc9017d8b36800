# mpistrategy: build, test and demo entry points.
#
#   make demo     set up everything, then train the Keras example on 2 MPI ranks
#   make test     set up everything, then run every test suite (what CI runs)
#   make lint     ruff (pyproject.toml [tool.ruff]) over the Python files
#   make build    op library -> mpistrategy/ops/_mpi_ops.so (CPU kernels),
#                 option validation -> mpistrategy/_config.so
#   make install  build, then install the package into .venv (pip, no compile)
#   make sdist    source distribution -> dist/mpistrategy-<version>.tar.gz
#   make build-cuda   + NCCL GPU kernels -> build/cuda/_mpi_ops.so (compile/link check)
#   make bench    allreduce benchmark on 2 ranks
#   make clean    remove build outputs (make distclean: also .venv and Bazel's cache)
#
# `demo` and `test` install what is missing on a fresh Debian/Ubuntu machine
# (apt: bazel-bootstrap, Open MPI; a .venv from requirements.txt), install
# mpistrategy itself into .venv (so `.venv/bin/python script.py` works in any
# directory) and are cheap to re-run once everything is in place.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build
# Stages must run in order, one at a time.
.NOTPARALLEL:

ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))

PYTHON3 ?= python3
VENV    := $(ROOT)/.venv
PY      := $(VENV)/bin/python
BAZEL   ?= bazel
MPIRUN  ?= mpirun
# iproute2: `ip`, for the simulated hosts of tests/multihost.
APT_PACKAGES := bazel-bootstrap libopenmpi-dev openmpi-bin libgtest-dev iproute2

# Wall-clock limits (seconds) per stage; a hang fails the stage.
TIMEOUT_SINGLE   ?= 1200
TIMEOUT_NP2      ?= 1200
TIMEOUT_NP3      ?= 1500
TIMEOUT_LAUNCHER ?= 1800
TIMEOUT_MULTIHOST ?= 1500
TIMEOUT_DEMO     ?= 900
TIMEOUT_BENCH    ?= 900
# Per-test limit (pytest-timeout).
export MPISTRATEGY_TEST_TIMEOUT ?= 180

# Bazel's repository rules find TensorFlow through PYTHON_BIN_PATH, which
# defaults to this checkout's .venv/bin/python (see WORKSPACE); left unset
# here so that `make build` and a bare `bazel build` see the same environment.
# Tests, demo and bench use the package installed into .venv (`make install`),
# never the checkout: no PYTHONPATH, and `python -P` keeps the current
# directory (the checkout) off sys.path.
unexport PYTHONPATH
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONUNBUFFERED := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1

ifeq ($(shell id -u),0)
SUDO :=
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
BAZEL_TEST_ENV := --test_env=OMPI_ALLOW_RUN_AS_ROOT=1 --test_env=OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
else
SUDO := $(shell command -v sudo 2>/dev/null)
BAZEL_TEST_ENV :=
endif

# Single-copy shared memory (CMA) fails in many containers; --bind-to none
# lets TF's thread pools use every core.
MPIRUN_FLAGS ?= --oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none \
                -x TF_CPP_MIN_LOG_LEVEL -x PYTHONUNBUFFERED
KILL_AFTER := --kill-after=30

LIB       := mpistrategy/ops/_mpi_ops.so
CONFIG_LIB := mpistrategy/_config.so
CUDA_LIB  := build/cuda/_mpi_ops.so
VENV_STAMP := $(VENV)/.requirements.stamp

# $(call stage,NAME,COMMAND): runs COMMAND in a `set -e` subshell (not in a
# `||` context, which would disable -e), prints its time, and on failure names
# the stage and stops with its exit status.  Pass COMMAND as a variable
# reference: literal commas would split the $(call) arguments.
define stage
	@echo "=== [$(1)] $$(date +%T) start"; _t0=$$(date +%s); \
	set +e; ( set -e; $(2) ) </dev/null; _rc=$$?; set -e; _dt=$$(( $$(date +%s) - _t0 )); \
	if [ $$_rc -eq 0 ]; then echo "=== [$(1)] ok ($${_dt}s)"; else \
	  case $$_rc in \
	    5) _why="pytest exit 5: no tests ran -- treated as a failure";; \
	    124|137) _why="timed out (hang?)";; \
	    *) _why="exit $$_rc";; \
	  esac; \
	  echo "=== [$(1)] FAILED: $$_why (after $${_dt}s) -- stopping" >&2; exit $$_rc; fi
endef

# Scripted Bazel runs stop the server afterwards (no idle JVM left behind),
# except between the stages of `make test` (BAZEL_KEEP_SERVER=1).
BAZEL_KEEP_SERVER ?= 0
BAZEL_SHUTDOWN_TRAP = trap '[ "$(BAZEL_KEEP_SERVER)" = 1 ] || $(BAZEL) shutdown' EXIT;

# Copies a Bazel output (read-only) over a possibly read-only older copy.
# Replaces by rename, so processes that have the old library loaded keep
# their (unlinked) copy instead of crashing.
COPY_LIB = copy_lib() { mkdir -p "$$(dirname "$$2")"; [ -e "$$2" ] && chmod u+w "$$2"; \
	cmp -s "$$1" "$$2" || { cp -f "$$1" "$$2.tmp.$$$$"; chmod u+w "$$2.tmp.$$$$"; \
	  mv -f "$$2.tmp.$$$$" "$$2"; }; chmod u+w "$$2"; echo "  -> $$2"; };

.PHONY: all help deps venv build build-cuda install sdist lint test demo bench clean distclean

all: build

help:
	@sed -n '2,15p' $(ROOT)/Makefile | sed 's/^# \{0,1\}//'

# ----------------------------------------------------------------- set-up
DEPS_CMD = missing=""; \
	for c in $(BAZEL) mpicc $(MPIRUN) g++; do command -v $$c >/dev/null || missing="$$missing $$c"; done; \
	pkgs="$(APT_PACKAGES)"; \
	if ! $(PYTHON3) -c 'import ensurepip, venv' 2>/dev/null; then missing="$$missing python3-venv"; pkgs="$$pkgs python3-venv"; fi; \
	[ -f /usr/include/gtest/gtest.h ] || missing="$$missing libgtest-dev"; \
	no_ip=""; command -v ip >/dev/null || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || no_ip=" ip"; \
	if [ -z "$$missing$$no_ip" ]; then echo "deps: bazel, mpicc, mpirun, g++, python3-venv, googletest, ip present"; exit 0; fi; \
	echo "deps: missing:$$missing$$no_ip -> apt-get install $$pkgs"; \
	if [ "$$(id -u)" != 0 ] && [ -z "$(SUDO)" ]; then \
	  if [ -z "$$missing" ]; then \
	    echo "deps: WARNING: no \`ip\` (iproute2) and no sudo: the multi-host tests will be skipped"; exit 0; fi; \
	  echo "deps: not root and no sudo: install $$pkgs yourself" >&2; exit 1; fi; \
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q; \
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$pkgs

deps:
	$(call stage,deps,$(DEPS_CMD))

VENV_CMD = if [ ! -x "$(PY)" ]; then echo "venv: creating $(VENV)"; $(PYTHON3) -m venv "$(VENV)"; fi; \
	"$(PY)" -m pip install --disable-pip-version-check --no-input --progress-bar off -q \
	    -r "$(ROOT)/requirements.txt"; \
	touch "$(VENV_STAMP)"

venv: $(VENV_STAMP)

$(VENV_STAMP): $(ROOT)/requirements.txt
	$(call stage,venv,$(VENV_CMD))

# ------------------------------------------------------------------ build
BUILD_CMD = $(BAZEL_SHUTDOWN_TRAP) $(COPY_LIB) \
	$(BAZEL) build //cc:_mpi_ops.so //cc:_config.so; \
	copy_lib bazel-bin/cc/_mpi_ops.so $(LIB); \
	copy_lib bazel-bin/cc/_config.so $(CONFIG_LIB)

build: deps venv
	$(call stage,build,$(BUILD_CMD))

BUILD_CUDA_CMD = $(BAZEL_SHUTDOWN_TRAP) $(COPY_LIB) \
	$(BAZEL) build --config=cuda //cc:_mpi_ops.so; \
	copy_lib bazel-bin/cc/_mpi_ops.so $(CUDA_LIB); \
	if [ -f tests/check_gpu_kernels.py ]; then \
	  "$(PY)" tests/check_gpu_kernels.py $(CUDA_LIB); \
	else echo "build-cuda: tests/check_gpu_kernels.py not there yet -- kernel check skipped"; fi; \
	echo "build-cuda: rebuilding the CPU library (bazel-bin/ and $(LIB) stay CPU)"; \
	$(BAZEL) build //cc:_mpi_ops.so; \
	copy_lib bazel-bin/cc/_mpi_ops.so $(LIB)

build-cuda: deps venv
	$(call stage,build-cuda,$(BUILD_CUDA_CMD))

# Installs the checkout into .venv as a user's pip would (a wheel, not an
# editable link), packaging the libraries `make build` compiled instead of
# compiling them again (setup.py: MPISTRATEGY_PREBUILT_LIBRARY,
# MPISTRATEGY_PREBUILT_CONFIG_LIBRARY).
INSTALL_CMD = MPISTRATEGY_PREBUILT_LIBRARY="$(ROOT)/$(LIB)" \
	MPISTRATEGY_PREBUILT_CONFIG_LIBRARY="$(ROOT)/$(CONFIG_LIB)" "$(PY)" -m pip install \
	    --disable-pip-version-check --no-input --progress-bar off -q \
	    --no-deps --no-build-isolation --force-reinstall "$(ROOT)"; \
	rm -rf "$(ROOT)/build/lib"* "$(ROOT)/build/bdist"* "$(ROOT)"/*.egg-info; \
	cd / && "$(PY)" -c 'import mpistrategy, sys; print("install:", mpistrategy.__version__, "->", mpistrategy.__file__)'

install: build
	$(call stage,install,$(INSTALL_CMD))

SDIST_CMD = "$(PY)" -m build --sdist --outdir "$(ROOT)/dist" "$(ROOT)"

sdist: venv
	$(call stage,sdist,$(SDIST_CMD))

# ------------------------------------------------------------------- test
BAZEL_TEST_CMD = trap '$(BAZEL) shutdown' EXIT; \
	if ! q=$$($(BAZEL) query 'tests(//cc/...)' 2>&1); then \
	  if grep -q 'no targets found beneath' <<<"$$q"; then q=""; else echo "$$q" >&2; exit 1; fi; fi; \
	if [ -z "$$(grep '^//' <<<"$$q" || true)" ]; then \
	  echo "bazel-test: SKIPPED: no cc_test targets under //cc yet"; exit 0; fi; \
	$(BAZEL) test //cc/... --test_output=errors $(BAZEL_TEST_ENV)

LINT_CMD = cd "$(ROOT)" && "$(PY)" -m ruff check --no-cache .

lint: venv
	$(call stage,lint,$(LINT_CMD))

PYTEST_FLAGS = -p no:randomly -p no:cacheprovider --timeout=$(MPISTRATEGY_TEST_TIMEOUT) --timeout-method=thread

# Two workers: most of the single-process stage is tests that start a fresh
# TensorFlow in a subprocess, one core each (240 s -> 144 s in one session at
# load 7).
SINGLE_CMD   = timeout $(KILL_AFTER) $(TIMEOUT_SINGLE) "$(PY)" -P -m pytest $(PYTEST_FLAGS) -n 2 --durations=10 tests/single
NP2_CMD      = tests/mpirun_pytest.sh 2 $(TIMEOUT_NP2) tests/parallel
NP3_CMD      = tests/mpirun_pytest.sh 3 $(TIMEOUT_NP3) tests/parallel
# Launcher and multi-host tests: two jobs at a time.  Much of a job is
# waiting (deadlines, signals, the pip route's downloads), so two overlap
# (launcher 633 s -> 547 s, multi-host 292 s -> 235 s in one session on 2
# cores); work stealing evens out the long tests, and tests/launcher starts
# the longest (the pip route) first.
PARALLEL_JOBS = -n 2 --dist worksteal
LAUNCHER_CMD = timeout $(KILL_AFTER) $(TIMEOUT_LAUNCHER) "$(PY)" -P -m pytest $(PYTEST_FLAGS) $(PARALLEL_JOBS) --durations=0 tests/launcher
# Simulated hosts (network namespaces; root only; every worker makes hosts
# of its own).  Where they cannot be made the tests are skipped and the
# summary says why (-rs); under CI they must run (MULTIHOST_REQUIRED=1 turns
# the skip into a failure).
MULTIHOST_CMD = MULTIHOST_REQUIRED=$${MULTIHOST_REQUIRED:-$$([ -n "$${CI:-}" ] && echo 1 || echo 0)} \
	timeout $(KILL_AFTER) $(TIMEOUT_MULTIHOST) "$(PY)" -P -m pytest $(PYTEST_FLAGS) $(PARALLEL_JOBS) -rs --durations=0 tests/multihost

test: BAZEL_KEEP_SERVER = 1
test: deps venv build build-cuda install
	$(call stage,lint,$(LINT_CMD))
	$(call stage,bazel-test,$(BAZEL_TEST_CMD))
	$(call stage,pytest-single,$(SINGLE_CMD))
	$(call stage,pytest-parallel-np2,$(NP2_CMD))
	$(call stage,pytest-parallel-np3,$(NP3_CMD))
	$(call stage,pytest-launcher,$(LAUNCHER_CMD))
	$(call stage,pytest-multihost,$(MULTIHOST_CMD))
	@echo "=== make test: all stages passed"

# ------------------------------------------------------------ demo, bench
DEMO_CMD  = timeout $(KILL_AFTER) $(TIMEOUT_DEMO) $(MPIRUN) -np 2 $(MPIRUN_FLAGS) "$(PY)" -P examples/keras_digits.py
BENCH_CMD = timeout $(KILL_AFTER) $(TIMEOUT_BENCH) $(MPIRUN) -np 2 $(MPIRUN_FLAGS) "$(PY)" -P bench/allreduce.py

demo: deps venv build install
	$(call stage,demo,$(DEMO_CMD))

bench: deps venv build install
	$(call stage,bench,$(BENCH_CMD))

# ------------------------------------------------------------------ clean
clean:
	@if command -v $(BAZEL) >/dev/null && [ -e bazel-bin ]; then $(BAZEL) clean; $(BAZEL) shutdown; fi
	rm -rf build dist *.egg-info .pytest_cache
	rm -f $(LIB) $(CONFIG_LIB)

distclean: clean
	@if command -v $(BAZEL) >/dev/null; then $(BAZEL) clean --expunge; $(BAZEL) shutdown; fi
	rm -rf $(VENV) bazel-*
