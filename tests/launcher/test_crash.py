"""A rank dies mid-training: every other rank must stop, and soon.

For each way of dying (unhandled exception, os._exit(3), SIGKILL) rank 1 of
2 dies at step 50 of a training loop while rank 0 keeps training.  Checked:
mpirun exits non-zero; the job is over within 10 s of the failure (measured
from the timestamp the failing rank printed just before dying); the output
says which rank failed (our abort message on a surviving rank, or mpirun's
own message); no process of the job is left running; the shared-memory
segment of the CPU data plane was gone from /dev/shm while the job ran and
still is.  A kill inside the segment's set-up, the one moment that can leave
it behind, is cleaned up by the host's next job.
"""

import json
import os
import re
import shutil
import subprocess
import time

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


@pytest.mark.timeout(150)
def test_timeline_files_are_complete_after_a_rank_raises(launch, tmp_path):
  """The excepthook ends the job with MPI_Abort, which runs no destructor.

  Each rank's engine closes its timeline file as it stops (Abort waits for
  that), so every file is valid JSON, not cut off mid-array.
  """
  pattern = str(tmp_path / "trace.{rank}.json")
  job = launch("crash.py", np=2, timeout=120,
               env={"MPISTRATEGY_TIMELINE": pattern},
               args=["--mode", "raise", "--fail-rank", str(FAIL_RANK),
                     "--fail-step", "20"])
  try:
    assert not job.timed_out, job.describe()
    assert job.returncode != 0, job.describe()
    job.event("FAIL", FAIL_RANK)
    for rank in range(2):
      path = tmp_path / f"trace.{rank}.json"
      text = path.read_text()
      try:
        events = json.loads(text)
      except ValueError as e:
        pytest.fail(f"{path.name} is not valid JSON ({e}); it ends with "
                    f"{text[-200:]!r}\n" + job.describe())
      names = {e.get("args", {}).get("name") for e in events
               if e.get("ph") == "M"}
      assert any(n and "allreduce" in n.lower() for n in names), (
          f"{path.name} has no allreduce row: {sorted(filter(None, names))}")
  finally:
    job.assert_no_leftovers()


# Killed inside the shared-memory set-up: the creating rank calls
# shm_unlink only once every rank has mapped the segment, so a SIGKILL just
# before that call is the one moment that can leave a segment behind.  This
# preload library kills the process at that call.
_KILL_AT_UNLINK = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <string.h>
int shm_unlink(const char* name) {
  if (strncmp(name, "/mpistrategy-", 13) == 0) raise(SIGKILL);
  int (*next)(const char*) = (int (*)(const char*))dlsym(RTLD_NEXT,
                                                         "shm_unlink");
  return next(name);
}
"""


def _segments():
  try:
    return {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")
            if n.startswith("mpistrategy-")}
  except FileNotFoundError:
    return set()


# Alone: another job could sweep the segment first.  The limit includes
# waiting for the other worker's test (the pip route: minutes).
@pytest.mark.alone
@pytest.mark.timeout(600)
def test_segment_left_by_a_kill_in_set_up_is_removed_by_next_job(
    launch, tmp_path):
  compiler = shutil.which("cc") or shutil.which("gcc")
  if compiler is None:
    pytest.skip("no C compiler for the fault-injecting preload library")
  source = tmp_path / "kill_at_unlink.c"
  source.write_text(_KILL_AT_UNLINK)
  preload = tmp_path / "kill_at_unlink.so"
  subprocess.run([compiler, "-shared", "-fPIC", "-o", str(preload),
                  str(source), "-ldl"], check=True)

  before = _segments()
  killed = launch("single.py", np=2, timeout=120,
                  env={"LD_PRELOAD": str(preload)})
  left = sorted(_segments() - before)
  try:
    killed.assert_no_leftovers()
    assert killed.returncode != 0 and not killed.timed_out, killed.describe()
    assert "signal 9" in killed.output, killed.describe()
    assert len(left) == 1, (f"expected the one segment of the killed set-up, "
                            f"found {left}\n" + killed.describe())
    # Older than any set-up can last: a later job on the host removes it.
    old = time.time() - 3600
    os.utime(left[0], (old, old))
    job = tmp_path / "one_allreduce.py"
    job.write_text("import numpy as np\n"
                   "import tensorflow as tf\n"
                   "from mpistrategy import ops\n"
                   "assert np.all(ops.allreduce(tf.ones([4])).numpy() == 2)\n")
    after = launch(str(job), np=2, timeout=120)
    after.assert_no_leftovers()
    assert after.returncode == 0, after.describe()
    assert not os.path.exists(left[0]), (
        f"{left[0]} survived the next job\n" + after.describe())
    said = [l for l in after.rank_lines(0)
            if f"removed {left[0]}, a shared-memory segment" in l]
    assert said, after.describe()
  finally:
    for path in left:
      if os.path.exists(path):
        os.unlink(path)
