#!/usr/bin/env bash
# GPU check of mpistrategy on a machine with an NVIDIA GPU (a fresh one is
# fine), in at most TOTAL_TIMEOUT seconds (default 300):
#
#   1. deps    apt: bazel-bootstrap libopenmpi-dev openmpi-bin (when bazel,
#              mpicc or mpirun is missing; needs root); .venv with
#              tensorflow[and-cuda]==2.21.0 + requirements.txt (when missing)
#   2. build   bazel build --config=cuda //cc:_mpi_ops.so, copied to
#              mpistrategy/ops/_mpi_ops.so; tests/check_gpu_kernels.py
#   3. np1     tests/gpu with 1 rank: NCCL on the op's stream
#   4. np2     tests/gpu with 2 processes sharing the GPU: NCCL refuses that,
#              so MPI with host staging (the log must say so)
#   5. bench   bench/allreduce.py --device gpu (1 rank, 2 rounds: each
#              round restarts the engine and its NCCL communicator)
#
# Stage 1 downloads (apt, PyPI: tensorflow[and-cuda] is several GB) unless
# bazel, mpicc, mpirun and g++ are installed and PYTHON (or .venv) already
# has tensorflow[and-cuda]==2.21.0, mpi4py and pytest; an offline machine
# needs all of those beforehand.
#
# Usage:  tests/gpu/run_on_gpu.sh
# Env:    OUT            folder for the logs (default build/gpu-logs); at
#                        most 8 files: summary.txt and one log per stage
#         PYTHON         a Python with tensorflow[and-cuda]==2.21.0 (skips
#                        the venv; default .venv/bin/python, made if missing)
#         TOTAL_TIMEOUT  seconds for everything (default 300)
#         MPIRUN         default mpirun
# Exit status: 0 when every stage passed; else the first failure's status.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
LOG_DIR=${OUT:-$ROOT/build/gpu-logs}
mkdir -p "$LOG_DIR"
SUMMARY=$LOG_DIR/summary.txt
: >"$SUMMARY"
DEADLINE=$((SECONDS + ${TOTAL_TIMEOUT:-300}))
MPIRUN=${MPIRUN:-mpirun}
VENV=$ROOT/.venv
PY=${PYTHON:-$VENV/bin/python}
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$(id -u)" == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
FIRST_FAILURE=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# stage NAME LIMIT_S COMMAND...: runs COMMAND (a shell function or program)
# with its output in $LOG_DIR/NAME.log, bounded by LIMIT_S and by what is
# left of TOTAL_TIMEOUT.
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit <= 5)); then
    note "[$name] SKIPPED: out of time (TOTAL_TIMEOUT)"
    ((FIRST_FAILURE == 0)) && FIRST_FAILURE=124
    return 124
  fi
  local t0=$SECONDS rc
  echo "=== [$name] start (limit ${limit}s)"
  # The stage functions run in a child bash (exported with export -f).
  timeout --kill-after=15 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 |
    tee "$LOG_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)); then
    note "[$name] ok ($((SECONDS - t0))s)"
  else
    case $rc in 124|137) rc=124; note "[$name] FAILED: timed out after ${limit}s";;
      *) note "[$name] FAILED: exit $rc ($((SECONDS - t0))s)";; esac
    ((FIRST_FAILURE == 0)) && FIRST_FAILURE=$rc
  fi
  return $rc
}

deps() {
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  local missing=""
  for c in bazel mpicc "$MPIRUN" g++; do
    command -v "$c" >/dev/null || missing="$missing $c"
  done
  if [[ -n "$missing" ]]; then
    echo "deps: missing:$missing -> apt-get install bazel-bootstrap libopenmpi-dev openmpi-bin"
    [[ "$(id -u)" == 0 ]] || { echo "deps: not root: install them yourself" >&2; return 1; }
    DEBIAN_FRONTEND=noninteractive apt-get update -q &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        bazel-bootstrap libopenmpi-dev openmpi-bin python3-venv || return 1
  fi
  if [[ "$PY" == "$VENV/bin/python" && ! -x "$PY" ]]; then
    python3 -m venv "$VENV" || return 1
  fi
  # tensorflow[and-cuda] brings the CUDA runtime and NCCL that TF (and so
  # the op library, through TF's stubs) loads at run time.
  if ! "$PY" -c 'import tensorflow, nvidia.nccl, nvidia.cuda_runtime, mpi4py, pytest, pytest_timeout' \
      2>/dev/null; then
    "$PY" -m pip install --disable-pip-version-check --no-input -q \
      "tensorflow[and-cuda]==2.21.0" -r "$ROOT/requirements.txt" || return 1
  fi
  "$PY" -c 'import tensorflow as tf; print("TF", tf.__version__, "GPUs:", tf.config.list_physical_devices("GPU"))'
}

build() {
  PYTHON_BIN_PATH=$PY bazel build --config=cuda //cc:_mpi_ops.so
  local rc=$?
  bazel shutdown >/dev/null 2>&1  # no idle Bazel server left behind
  ((rc == 0)) || return $rc
  # The CUDA build's output tree (platform_suffix=cuda, see .bazelrc).
  local lib
  lib=$(ls -t bazel-out/k8-*cuda/bin/cc/_mpi_ops.so 2>/dev/null | head -1)
  [[ -n "$lib" ]] || { echo "build: no CUDA _mpi_ops.so under bazel-out/" >&2; return 1; }
  [[ -e mpistrategy/ops/_mpi_ops.so ]] && chmod u+w mpistrategy/ops/_mpi_ops.so
  cp -f "$lib" mpistrategy/ops/_mpi_ops.so && chmod u+w mpistrategy/ops/_mpi_ops.so
  "$PY" tests/check_gpu_kernels.py mpistrategy/ops/_mpi_ops.so
}

# gpu_tests NP MUST_LOG: the GPU tests on NP ranks; the ranks' log must
# contain MUST_LOG (which transport the engine chose).
gpu_tests() {
  local np=$1 must=$2 log rc
  log=$(mktemp)
  # -s: the engine's one-line transport choice (C++ stderr) reaches the log.
  PYTHON=$PY MPIRUN=$MPIRUN MPISTRATEGY_TEST_TIMEOUT=60 \
    tests/mpirun_pytest.sh "$np" 80 tests/gpu -s -rs 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if grep -q "no GPU visible\|has no GPU kernels\|cannot be loaded" "$log"; then
    echo "gpu_tests: the GPU tests were skipped (see the reasons above)" >&2
    ((rc == 0)) && rc=3
  fi
  if ! grep -q "$must" "$log"; then
    echo "gpu_tests: expected the engine to log '$must'" >&2
    ((rc == 0)) && rc=4
  fi
  rm -f "$log"
  return "$rc"
}

bench() {
  "$MPIRUN" -np 1 --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED \
    -x TF_CPP_MIN_LOG_LEVEL "$PY" bench/allreduce.py --device gpu \
    --rounds 2 --json "$LOG_DIR/bench.json"
}

export ROOT LOG_DIR MPIRUN VENV PY
export -f deps build gpu_tests bench

note "mpistrategy GPU check, $(date -u +%FT%TZ), $(hostname)"
stage deps 150 deps || { note "stopping: dependencies missing"; exit "$FIRST_FAILURE"; }
stage build 150 build || { note "stopping: build failed"; exit "$FIRST_FAILURE"; }
stage np1 90 gpu_tests 1 "NCCL 2\.[0-9]*\.[0-9]* over 1 rank"
stage np2 90 gpu_tests 2 "NCCL cannot be used .*host staging"
stage bench 60 bench
note "done: exit $FIRST_FAILURE"
exit "$FIRST_FAILURE"
