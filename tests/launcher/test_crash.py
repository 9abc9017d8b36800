"""A rank dies mid-training: every other rank must stop, and soon.

For each way of dying (unhandled exception, os._exit(3), SIGKILL) rank 1 of
2 dies at step 50 of a training loop while rank 0 keeps training.  Checked:
mpirun exits non-zero; the job is over within 10 s of the failure (measured
from the timestamp the failing rank printed just before dying); the output
says which rank failed (our abort message on a surviving rank, or mpirun's
own message); no process of the job is left running; the shared-memory
segment of the CPU data plane was gone from /dev/shm while the job ran and
still is.
"""

import os
import re

import pytest

FAIL_RANK = 1
MAX_STOP_SECONDS = 10.0

# "rank 1" as our abort message or mpirun's messages say it: "rank 1 raised",
# "MPI_ABORT was invoked on rank 1", "process rank 1 with PID", or mpirun's
# "Process name: [[<jobid>,1],1]" (job family, vpid = rank).
_NAMES_RANK = re.compile(
    rf"\brank\s*{FAIL_RANK}\b|Process name:\s*\[\[\d+,\d+\],{FAIL_RANK}\]",
    re.IGNORECASE)


_JOBS = {}


def _crash_job(launch, mode):
  """Runs crash.py once per mode per session (two tests share "raise")."""
  if mode not in _JOBS:
    _JOBS[mode] = launch("crash.py", np=2, timeout=120,
                         args=["--mode", mode, "--fail-rank", str(FAIL_RANK)])
  return _JOBS[mode]


def _evidence_lines(job):
  """Lines that are not the failing rank's own output."""
  lines = job.untagged_text().splitlines()
  for rank in range(2):
    if rank != FAIL_RANK:
      lines += job.rank_lines(rank)
  return [l for l in lines if not l.startswith("@@ ")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["raise", "exit", "kill"])
def test_rank_failure_stops_the_job(launch, mode):
  job = _crash_job(launch, mode)
  try:
    assert not job.timed_out, "the job hung after a rank failed\n" + \
        job.describe()
    fail = job.event("FAIL", FAIL_RANK)
    assert job.returncode != 0, job.describe()
    assert not job.events("FINISHED"), job.describe()

    stop = job.end - fail.time
    assert stop <= MAX_STOP_SECONDS, (
        f"the job ran on for {stop:.1f} s after rank {FAIL_RANK} failed "
        f"(limit {MAX_STOP_SECONDS} s)\n" + job.describe())
    print(f"{mode}: job over {stop:.2f} s after the failure")
    for caught in job.events("CAUGHT"):
      assert caught.time - fail.time <= MAX_STOP_SECONDS, job.describe()

    evidence = [l for l in _evidence_lines(job) if _NAMES_RANK.search(l)]
    assert evidence, (f"nothing outside rank {FAIL_RANK}'s own output says "
                      f"that rank {FAIL_RANK} failed\n" + job.describe())
    if mode == "raise":
      # The exception itself is reported, with its message.
      assert "injected failure on rank 1" in job.rank_text(FAIL_RANK), \
          job.describe()
    # The ranks share one host: CPU tensors went through shared memory, whose
    # segment was unlinked once mapped, so even SIGKILL leaves nothing.
    for rank in range(2):
      words = job.event("SHM", rank).text.split()
      assert len(words) == 2 and words[1] == "gone", job.describe()
      assert not os.path.exists(words[0]), f"{words[0]} left behind"
  finally:
    job.assert_no_leftovers()


@pytest.mark.timeout(150)
def test_abort_message_reaches_surviving_rank(launch):
  """An unhandled exception is announced to the others by our excepthook.

  mpirun alone would also stop the job; this checks the library's part: the
  surviving rank's pending allreduce fails with an error naming the rank
  and the exception before MPI_Abort tears the job down.
  """
  job = _crash_job(launch, "raise")
  try:
    assert not job.timed_out, job.describe()
    caught = job.events("CAUGHT", rank=0)
    assert caught, ("rank 0 never saw an error from its pending allreduce "
                    "(killed by MPI_Abort before the abort reached it?)\n"
                    + job.describe())
    text = caught[0].text
    assert text.startswith("AbortedError"), job.describe()
    assert _NAMES_RANK.search(text), job.describe()
    assert "RuntimeError" in text, job.describe()
  finally:
    job.assert_no_leftovers()
