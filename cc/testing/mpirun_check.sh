#!/usr/bin/env bash
# Runs a check program under mpirun, once per RUN, each under TIMEOUT
# seconds, so a hang fails instead of blocking:
#
#   mpirun_check.sh PROGRAM TIMEOUT RUN [RUN ...]
#
# A RUN is the number of ranks, then the program's arguments, joined by
# commas ("2", "4,--ranks-per-host=2"): Bazel splits an sh_test's args at
# spaces.  Exit status 0 when every run passed.
set -uo pipefail
program="$1"
limit="$2"
shift 2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
flags=(--oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none)
status=0
for run in "$@"; do
  IFS=, read -r -a words <<<"$run"
  echo "=== mpirun -np ${words[0]} $(basename "$program") ${words[*]:1}"
  if ! timeout "$limit" mpirun "${flags[@]}" -np "${words[0]}" "$program" \
      "${words[@]:1}"; then
    echo "=== FAILED: np ${words[*]}"
    status=1
  fi
done
exit $status
