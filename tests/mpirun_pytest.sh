#!/usr/bin/env bash
# Multi-rank pytest:  tests/mpirun_pytest.sh NP TIMEOUT_S [pytest args...]
#
#   tests/mpirun_pytest.sh 2 900 tests/parallel
#   tests/mpirun_pytest.sh 3 1200 tests/parallel -k allreduce
#
# Runs `mpirun -np NP python -m pytest ...`: every rank runs the same tests in
# the same order (no random ordering, no cache); rank 0 reports normally, the
# other ranks print failures and a one-line summary (tests/conftest.py).
# * Exit status: 0 only if every rank passed.  Any failing rank fails the run
#   (mpirun returns non-zero when a rank exits non-zero).  "No tests ran"
#   (pytest exit 5) is a failure too.
# * TIMEOUT_S bounds the whole mpirun (coreutils timeout, then SIGKILL 30 s
#   later): a hang fails with exit 124.  Each test is also bounded by
#   pytest-timeout (MPISTRATEGY_TEST_TIMEOUT, default 120 s; thread method:
#   dumps all stacks and exits that rank, which makes mpirun stop the job).
# Env: PYTHON (default .venv/bin/python), MPIRUN (default mpirun),
#      MPIRUN_ARGS (extra mpirun flags), MPISTRATEGY_TEST_TIMEOUT.
set -uo pipefail

if [[ $# -lt 2 || ! "$1" =~ ^[0-9]+$ || ! "$2" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 NP TIMEOUT_S [pytest args...]" >&2
  exit 2
fi
NP=$1
TIMEOUT_S=$2
shift 2

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
MPIRUN=${MPIRUN:-mpirun}
PER_TEST_TIMEOUT=${MPISTRATEGY_TEST_TIMEOUT:-120}

if [[ ! -x "$PYTHON" ]] && ! command -v "$PYTHON" >/dev/null; then
  echo "mpirun_pytest: $PYTHON not found (run 'make venv')" >&2
  exit 2
fi
command -v "$MPIRUN" >/dev/null || { echo "mpirun_pytest: $MPIRUN not found (run 'make deps')" >&2; exit 2; }

# Open MPI refuses to start as root without these.
if [[ "$(id -u)" == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# More ranks than cores is fine for tests (Open MPI then also yields when idle).
export OMPI_MCA_rmaps_base_oversubscribe=1
# The ranks import the installed mpistrategy (`make install`), not the
# checkout: `python -P` keeps the current directory off sys.path, and
# tests/conftest.py stops the run if the install is stale.  A PYTHONPATH the
# caller set (e.g. a private install) is forwarded.
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
export PYTHONUNBUFFERED=1
# No stdin for the ranks (CI has none; pytest must never wait on input).

fwd=(-x TF_CPP_MIN_LOG_LEVEL -x PYTHONUNBUFFERED)
[[ -n "${PYTHONPATH:-}" ]] && fwd+=(-x PYTHONPATH)
while IFS='=' read -r name _; do
  [[ -n "$name" ]] && fwd+=(-x "$name")
done < <(env | grep -E '^(MPISTRATEGY_|CUDA_VISIBLE_DEVICES=|NCCL_)' || true)

mpirun_flags=(
  -np "$NP"
  --oversubscribe
  --bind-to none
  # Single-copy (CMA) shared memory fails in many containers (ptrace scope).
  --mca btl_vader_single_copy_mechanism none
  "${fwd[@]}"
)
# shellcheck disable=SC2206
[[ -n "${MPIRUN_ARGS:-}" ]] && mpirun_flags+=(${MPIRUN_ARGS})

pytest_flags=(
  -p no:randomly -p no:cacheprovider
  --timeout="$PER_TEST_TIMEOUT" --timeout-method=thread
  -o console_output_style=classic
)
# Ranks write through mpirun's pseudo-tty: color only if we print to a tty.
[[ -t 1 ]] || pytest_flags+=(--color=no)

echo "== mpirun -np $NP (timeout ${TIMEOUT_S}s, per test ${PER_TEST_TIMEOUT}s): pytest $*"
timeout --kill-after=30 "$TIMEOUT_S" \
  "$MPIRUN" "${mpirun_flags[@]}" \
  "$PYTHON" -P -m pytest "${pytest_flags[@]}" "$@" </dev/null
rc=$?

case $rc in
  0) echo "== mpirun -np $NP: all ranks passed" ;;
  5) echo "== mpirun -np $NP: FAILED: no tests ran (pytest exit 5) -- check paths/filters/imports" >&2 ;;
  124|137) echo "== mpirun -np $NP: FAILED: timed out after ${TIMEOUT_S}s (hang?)" >&2 ;;
  *) echo "== mpirun -np $NP: FAILED (exit $rc): at least one rank failed" >&2 ;;
esac
exit $rc
