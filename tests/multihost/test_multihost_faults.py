"""Faults on the second host while 2 hosts x 2 ranks (or 2 + 1) train.

Each test starts `mh_rank.py --part train` (an allreduce of the gradients
every step) on hosta:2,hostb:2, waits until every rank reports progress,
injects a fault on hostb and then checks: the exit status of mpirun, how
long after the fault it ended, that the output names the culprit rank and
its host, and that no process is left on either host within the limit.
The time until every process is gone is recorded for the summary.

Rank death (`kill -9`) is handled today.  Link down and a long SIGSTOP need
the engine's peer deadline (issue #14 item 1); these tests are written
against its contract:
  * MPISTRATEGY_PEER_TIMEOUT_SECONDS sets the deadline (PEER_TIMEOUT here);
  * after it, every reachable rank prints to stderr and raises an error that
    contains `peer_timeout_seconds` and, for each silent rank,
    `rank N (host HOSTNAME, pid PID)`;
  * mpirun exits non-zero and no process is left on any host -- the cut-off
    side included, which stops by itself -- within deadline + 10 s;
  * a rank frozen for less than the deadline resumes; the job ends normally.
Each job is killed PEER_TIMEOUT + STOP_MARGIN + a few seconds after the fault
at the latest, so a hang fails the test quickly.
"""

import json
import os
import re
import signal
import time

import pytest

from conftest import PYTHON
from conftest import describe_hosts
from conftest import rank_pids
from conftest import record
from conftest import wait_hosts_empty

SIZE = 4
VICTIM = 2                 # the first rank on hostb
PEER_TIMEOUT = 10.0        # MPISTRATEGY_PEER_TIMEOUT_SECONDS
STOP_MARGIN = 10.0         # everything gone within deadline + this
KILL_LIMIT = 10.0          # kill -9: job over and hosts empty within this
# TF start-up on 4 ranks (loaded 2 cores) until PROGRESS.
START_TIMEOUT = 240
GRACE = 5.0                # hard kill this long after a limit was missed
TRAIN_SECONDS = 60.0       # long enough that no fault lands after the end
# The launcher's wrapper of every rank; -P: the installed mpistrategy.
QUIET = (PYTHON, "-P", "-m", "mpistrategy.quiet")


def _start(mpirun_job, seconds=TRAIN_SECONDS, env=None, hosts=None,
           wrapper=()):
  """Starts training on `hosts` (default hosta:2,hostb:2)."""
  env = dict({"MPISTRATEGY_PEER_TIMEOUT_SECONDS": str(PEER_TIMEOUT)},
             **(env or {}))
  hosts = hosts or "hosta:2,hostb:2"
  size = sum(int(h.split(":")[1]) for h in hosts.split(","))
  job = mpirun_job(["--part", "train", "--seconds", str(seconds)], env=env,
                   hosts=hosts, np=size,
                   timeout=START_TIMEOUT + int(seconds) + 60,
                   wrapper=wrapper)
  if not job.wait_for("PROGRESS", range(size), START_TIMEOUT):
    job.kill()
    job.wait()
    pytest.fail("the job did not start training on every rank\n"
                + job.describe())
  return job


def _names_rank(rank, host, pid):
  """The contract's `rank N (host H, pid P)`."""
  return re.compile(rf"\brank {rank} \(host {re.escape(host)}, pid {pid}\)")


def _assert_names(job, rank, silent):
  """`rank`'s output has the peer-timeout error naming every silent rank."""
  lines = [l for l in job.rank_text(rank).splitlines()
           if "peer_timeout_seconds" in l]
  assert lines, (f"rank {rank} printed nothing with `peer_timeout_seconds` "
                 "(no timeout error, or killed before it could print)\n"
                 + job.describe())
  for r, host, pid in silent:
    assert any(_names_rank(r, host, pid).search(l) for l in lines), (
        f"rank {rank}'s timeout error does not name `rank {r} (host {host}, "
        f"pid {pid})`\n" + job.describe())


def _gone(cluster, job, fault_time, limit, scenario):
  """Waits for the job and the hosts to be done, at most `limit` + GRACE
  after the fault, then kills what is left; records the times.

  Returns:
    (seconds from the fault to mpirun's exit (or to the kill), the time the
    hosts were found empty or None, a listing of the processes left or None).
  """
  job.wait(timeout=max(0.0, fault_time + limit + GRACE - time.time()),
           kill=False)
  gone_at = wait_hosts_empty(cluster, fault_time + limit + GRACE)
  left = None if gone_at is not None else describe_hosts(cluster)
  job.wait(timeout=0)  # kills the job if it still runs
  end = job.end - fault_time
  ended = ("killed by the test" if job.timed_out else
           f"exit {job.returncode}")
  if gone_at is not None:
    record(scenario, f"mpirun {ended} after {end:.1f} s; every process gone "
           f"after {gone_at - fault_time:.1f} s")
  else:
    record(scenario, f"mpirun {ended} after {end:.1f} s; processes still "
           f"ran {limit + GRACE:g} s after the fault (then killed)")
  return end, gone_at, left


@pytest.mark.timeout(START_TIMEOUT + 120)
def test_kill_9_of_a_rank_on_the_second_host(mpirun_job, cluster):
  job = _start(mpirun_job)
  pid, host = rank_pids(job)[VICTIM]
  assert host == "hostb" and pid in [
      p for p, _ in cluster.processes()["hostb"]], job.describe()
  fault = time.time()
  os.kill(pid, signal.SIGKILL)
  end, gone_at, left = _gone(cluster, job, fault, KILL_LIMIT,
                             "kill -9 of a rank on hostb")
  assert not job.timed_out, "the job hung after kill -9\n" + job.describe()
  assert job.returncode != 0, job.describe()
  assert end <= KILL_LIMIT, f"mpirun ended {end:.1f} s after the kill\n" + \
      job.describe()
  assert left is None and gone_at - fault <= KILL_LIMIT, (
      f"processes left {KILL_LIMIT} s after the kill:\n{left}\n"
      + job.describe())
  # mpirun's "process rank 2 with PID P on node hostb exited on signal 9",
  # or our own "rank 2 (host hostb, pid P)".
  says = re.compile(rf"rank {VICTIM} with PID {pid} on node hostb|"
                    + _names_rank(VICTIM, "hostb", pid).pattern)
  assert says.search(job.output), (
      f"nothing names rank {VICTIM} on hostb\n" + job.describe())
  assert not job.events("FINISHED"), job.describe()


@pytest.mark.timeout(START_TIMEOUT + 120)
@pytest.mark.parametrize("wrapper", [(), QUIET], ids=["plain", "quiet"])
def test_link_down_mid_training(mpirun_job, cluster, wrapper):
  """hostb's link goes down for good: both sides stop by the deadline.

  Also with every rank behind `python -m mpistrategy.quiet` (what the
  launcher does): the cut-off host's orted is then the ranks' grandparent,
  and must still be ended.
  """
  job = _start(mpirun_job, wrapper=wrapper)
  pids = rank_pids(job)
  fault = time.time()
  cluster.set_link("hostb", False)
  limit = PEER_TIMEOUT + STOP_MARGIN
  end, gone_at, left = _gone(cluster, job, fault, limit, "link down (hostb)")
  assert not job.timed_out, (
      f"mpirun still ran {end:.0f} s after hostb's link went down (deadline "
      f"{PEER_TIMEOUT:g} s + {STOP_MARGIN:g} s; killed); still running "
      f"then:\n{left}\n" + job.describe())
  assert job.returncode != 0, job.describe()
  assert end <= limit, job.describe()
  # The reachable ranks (hosta) name both silent ranks; hostb's output
  # cannot reach mpirun any more.
  for rank in (0, 1):
    _assert_names(job, rank, [(s, "hostb", pids[s][0]) for s in (2, 3)])
  assert left is None and gone_at - fault <= limit, (
      f"processes left {limit:g} s after the link went down (still down):"
      f"\n{left}\n" + job.describe())


@pytest.mark.timeout(START_TIMEOUT + 120)
def test_sigstop_shorter_than_the_deadline(mpirun_job, cluster):
  """A rank frozen for 4 s (deadline 10 s) resumes; the job ends normally."""
  frozen = 4.0
  seconds = 15.0
  job = _start(mpirun_job, seconds=seconds)
  pid, _ = rank_pids(job)[VICTIM]
  fault = time.time()
  os.kill(pid, signal.SIGSTOP)
  try:
    time.sleep(frozen)
  finally:
    os.kill(pid, signal.SIGCONT)
  limit = seconds + 30
  end, gone_at, left = _gone(cluster, job, fault, limit,
                             f"SIGSTOP {frozen:g} s (< deadline)")
  assert not job.timed_out, job.describe()
  assert job.returncode == 0, job.describe()
  assert "peer_timeout_seconds" not in job.output, job.describe()
  finished = [json.loads(job.event_text("FINISHED", r)) for r in range(SIZE)]
  assert all(f["sum"] == 10.0 for f in finished), finished
  assert len({(f["steps"], f["w"]) for f in finished}) == 1, finished
  # Progress went on after the freeze, on the frozen rank too.
  assert [t for _, t, _ in job.events("PROGRESS", VICTIM)
          if t > fault + frozen], job.describe()
  assert left is None, left


def _freeze_for_good(mpirun_job, cluster, hosts, survivors, scenario):
  """Freezes rank VICTIM (on hostb) for good; the others name it and the
  job ends, every process gone, by the deadline + STOP_MARGIN."""
  job = _start(mpirun_job, hosts=hosts)
  pid, host = rank_pids(job, size=len(survivors) + 1)[VICTIM]
  assert host == "hostb", job.describe()
  fault = time.time()
  os.kill(pid, signal.SIGSTOP)
  limit = PEER_TIMEOUT + STOP_MARGIN
  end, gone_at, left = _gone(cluster, job, fault, limit, scenario)
  assert not job.timed_out, (
      f"mpirun still ran {end:.0f} s after rank {VICTIM} froze (deadline "
      f"{PEER_TIMEOUT:g} s + {STOP_MARGIN:g} s; killed); still running "
      f"then:\n{left}\n" + job.describe())
  assert job.returncode != 0, job.describe()
  assert end <= limit, job.describe()
  for rank in survivors:
    _assert_names(job, rank, [(VICTIM, "hostb", pid)])
  assert left is None and gone_at - fault <= limit, (
      f"processes left {limit:g} s after the freeze:\n{left}\n"
      + job.describe())


@pytest.mark.timeout(START_TIMEOUT + 120)
def test_sigstop_longer_than_the_deadline(mpirun_job, cluster):
  """A rank frozen for good: the others name it and the job ends."""
  _freeze_for_good(mpirun_job, cluster, "hosta:2,hostb:2", (0, 1, 3),
                   "SIGSTOP for good (> deadline)")


@pytest.mark.timeout(START_TIMEOUT + 120)
def test_sigstop_of_a_host_of_one_rank(mpirun_job, cluster):
  """hosta:2,hostb:1: hostb's only rank freezes for good.

  Hosts of different sizes allreduce across hosts from each host's first
  rank: rank 0 waits for the frozen rank in MPI, rank 1 inside hosta's
  shared memory for rank 0.  Both must name the frozen rank by the
  deadline.
  """
  _freeze_for_good(mpirun_job, cluster, "hosta:2,hostb:1", (0, 1),
                   "SIGSTOP of hostb's only rank (2 + 1 ranks)")
