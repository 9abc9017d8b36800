#!/usr/bin/env bash
# Runs mpi_transport_check (MpiTransport and the engine over real MPI) under
# mpirun at np 2 and 3.  Every run has a timeout, so a hang fails.
set -uo pipefail
bin="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
flags=(--oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none)
status=0
for np in 2 3; do
  echo "=== mpirun -np $np mpi_transport_check"
  if ! timeout 120 mpirun "${flags[@]}" -np "$np" "$bin"; then
    echo "=== FAILED: np $np"
    status=1
  fi
done
exit $status
