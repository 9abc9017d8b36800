"""MPI_Init and MPI_Finalize say that they wait for a rank.

Before the engine starts and after it stopped, no peer timeout runs: MPI
waits for every rank there, without a deadline, as in any MPI program.  A
rank frozen then (importing TensorFlow, at exit) held the others without
a word.  Now a waiting rank logs it after `stall_warning_seconds` (1 s
here) and at each doubling of the wait.
"""

import re

import pytest

ENV = {"MPISTRATEGY_STALL_WARNING_SECONDS": "1"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("late,call,cause", [
    ("start", "MPI_Init", "to start"),
    ("end", "MPI_Finalize at exit", "to end"),
])
def test_a_rank_waiting_for_a_late_one_says_so(launch, late, call, cause):
  job = launch("mpi_waits.py", np=2, timeout=150, env=ENV,
               args=["--late", late, "--seconds", "5"])
  assert not job.timed_out, job.describe()
  assert job.returncode == 0, job.describe()
  assert len(job.events("ENDING")) == 2, job.describe()
  said = re.findall(
      r"\[mpistrategy rank 0 \(host [^)]*\)\] has waited (\d+) s in "
      + re.escape(call) + " for the other ranks " + cause, job.output)
  assert said[:2] == ["1", "2"], job.describe()
  # Rank 1 never waited.
  assert "[mpistrategy rank 1 " not in job.output, job.describe()
