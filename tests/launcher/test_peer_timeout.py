"""A rank frozen with SIGSTOP: the job ends after peer_timeout_seconds.

freeze.py on 3 ranks; rank 0 stops rank 1 with SIGSTOP at step 5.
* Longer than the deadline (never continued): ranks 0 and 2 log the silent
  rank after stall_warning_seconds, fail their collective with
  UnavailableError naming `rank 1 (host H, pid P)` and `peer_timeout_seconds`
  after the deadline, and the job ends by itself (the Python code catches
  the error and lingers): mpirun exits non-zero and no process is left
  within deadline + 10 s of the freeze.
* The coordinator (rank 0) frozen: ranks 1 and 2 stop by themselves,
  naming rank 0 as the silent coordinator, within the same bounds.
* Shorter than the deadline (SIGCONT after 3 s of a 10 s deadline): every
  step completes with the right result and the job exits 0.
"""

import re

import pytest

FROZEN = 1
DEADLINE_S = 8.0
WARNING_S = 3.0


@pytest.fixture(scope="module")
def frozen_job(launch):
  job = launch("freeze.py", np=3, timeout=150,
               env={"MPISTRATEGY_PEER_TIMEOUT_SECONDS": str(DEADLINE_S),
                    "MPISTRATEGY_STALL_WARNING_SECONDS": str(WARNING_S)},
               args=["--frozen-rank", str(FROZEN), "--linger", "120"])
  yield job
  job.assert_no_leftovers()


def _frozen_identity(job):
  """(host, pid) of the frozen rank, as it reported them."""
  init = job.event("INIT", FROZEN)
  m = re.match(r"pid=(\d+) host=(\S+)", init.text)
  assert m, init.text
  return m.group(2), int(m.group(1))


@pytest.mark.timeout(180)
def test_frozen_rank_ends_the_job_within_the_deadline(frozen_job):
  job = frozen_job
  assert not job.timed_out, "the job hung\n" + job.describe()
  freeze = job.event("FREEZE", 0)
  assert job.returncode != 0, job.describe()
  assert not job.events("FINISHED"), job.describe()
  gone = job.end - freeze.time
  print(f"SIGSTOP > deadline: job over {gone:.1f} s after the freeze "
        f"(deadline {DEADLINE_S} s)")
  assert DEADLINE_S - 1 <= gone <= DEADLINE_S + 10, (
      f"job over {gone:.1f} s after the freeze, deadline {DEADLINE_S} s\n"
      + job.describe())
  # The library ended the processes although Python caught the error.
  for rank in (0, 2):
    job.event("LINGER", rank)
    assert not job.events("LINGER_OVER", rank), job.describe()


@pytest.mark.timeout(180)
def test_every_reachable_rank_names_the_frozen_rank(frozen_job):
  job = frozen_job
  host, pid = _frozen_identity(job)
  named = f"rank {FROZEN} (host {host}, pid {pid})"
  freeze = job.event("FREEZE", 0)
  for rank in (0, 2):
    caught = job.event("CAUGHT", rank)
    assert caught.text.startswith("UnavailableError"), job.describe()
    assert named in caught.text, (named, job.describe())
    assert "peer_timeout_seconds" in caught.text, job.describe()
    waited = caught.time - freeze.time
    assert DEADLINE_S - 1 <= waited <= DEADLINE_S + 3, (waited,
                                                        job.describe())
    # Printed on stderr by the engine too, before the process ended.
    text = job.rank_text(rank)
    assert re.search(r"peer timeout.*" + re.escape(named), text), text
    # ... after the warning (stall_warning_seconds) naming the same rank.
    assert re.search(r"no message from " + re.escape(named) + r"|"
                     r"has had no message from " + re.escape(named), text), \
        text


@pytest.mark.timeout(180)
def test_frozen_coordinator_makes_the_others_stop_by_themselves(launch):
  job = launch("freeze.py", np=3, timeout=150,
               env={"MPISTRATEGY_PEER_TIMEOUT_SECONDS": str(DEADLINE_S)},
               args=["--frozen-rank", "0", "--linger", "120"])
  try:
    assert not job.timed_out, "the job hung\n" + job.describe()
    assert job.returncode != 0, job.describe()
    freeze = job.event("FREEZE", 1)
    gone = job.end - freeze.time
    print(f"coordinator SIGSTOP: job over {gone:.1f} s after the freeze")
    assert DEADLINE_S - 1 <= gone <= DEADLINE_S + 10, (gone, job.describe())
    init = job.event("INIT", 0)
    m = re.match(r"pid=(\d+) host=(\S+)", init.text)
    named = f"rank 0 (host {m.group(2)}, pid {m.group(1)}), the coordinator"
    for rank in (1, 2):
      caught = job.event("CAUGHT", rank)
      assert caught.text.startswith("UnavailableError"), job.describe()
      assert named in caught.text, (named, job.describe())
      assert "peer_timeout_seconds" in caught.text, job.describe()
  finally:
    job.assert_no_leftovers()


@pytest.mark.timeout(180)
def test_rank_frozen_shorter_than_the_deadline_resumes(launch):
  job = launch("freeze.py", np=3, timeout=150,
               env={"MPISTRATEGY_PEER_TIMEOUT_SECONDS": "10",
                    "MPISTRATEGY_STALL_WARNING_SECONDS": "2"},
               args=["--frozen-rank", str(FROZEN), "--freeze-seconds", "3",
                     "--steps", "20"])
  try:
    assert not job.timed_out, job.describe()
    assert job.returncode == 0, job.describe()
    job.event("THAW", 0)
    for rank in range(3):
      job.event("FINISHED", rank)
    assert not job.events("STEP_ERROR"), job.describe()
    assert not job.events("CAUGHT"), job.describe()
    assert "peer timeout" not in job.output, job.describe()
  finally:
    job.assert_no_leftovers()
