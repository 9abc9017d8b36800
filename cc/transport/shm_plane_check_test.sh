#!/usr/bin/env bash
# Runs shm_plane_check under mpirun at np 2 (with an allreduce of more than
# 2^31 bytes) and np 3.  Every run has a timeout, so a hang fails.
set -uo pipefail
bin="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
flags=(--oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none)
status=0
run() {
  echo "=== mpirun -np $1 shm_plane_check ${*:2}"
  if ! timeout 300 mpirun "${flags[@]}" -np "$1" "$bin" "${@:2}"; then
    echo "=== FAILED: np $1 ${*:2}"
    status=1
  fi
}
run 2 --large
run 3
exit $status
