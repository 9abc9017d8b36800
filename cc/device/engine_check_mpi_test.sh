#!/usr/bin/env bash
# Runs tests/gpu/engine_check on the fake device under mpirun: host staging
# at np 2 and 3, hierarchical on simulated hosts (2 hosts of 2 ranks, 3 of
# 2).  Every run has a timeout, so a hang fails.
set -uo pipefail
bin="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
flags=(--oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none)
status=0
run() {
  echo "=== mpirun -np $1 engine_check_fake ${*:2}"
  if ! timeout 120 mpirun "${flags[@]}" -np "$1" "$bin" "${@:2}"; then
    echo "=== FAILED: np $1 ${*:2}"
    status=1
  fi
}
run 2
run 3
run 4 --ranks-per-host=2
run 6 --ranks-per-host=2
exit $status
