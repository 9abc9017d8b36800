"""Shared memory that one simulated host cannot provide.

hostb's /dev/shm is a tmpfs too small for the CPU data plane's segment
(16 MiB; Open MPI's own segments still fit), hosta's is not.  Every host
must agree on the plane, so:
  * data_plane "auto": every CPU collective goes through MPI, on hosta too;
    rank 0 logs once that another host's first rank says why, and hostb's
    first rank logs why (its /dev/shm's free bytes);
  * data_plane "shm": the first collective fails on every rank with that
    reason, and nothing hangs.
"""

import time

import pytest

from conftest import describe_hosts
from conftest import op_results
from conftest import wait_hosts_empty

SIZE = 4
HOSTB_SHM_BYTES = 12 << 20
# TF start-up on 4 ranks (loaded 2 cores) and a few collectives.
TIMEOUT = 240
# After mpirun's exit, until no rank is left (a failed job's are killed).
GONE_SECONDS = 15
_NOT_HERE = "shared memory unavailable on this host: /dev/shm has"
_ELSEWHERE = ("shared memory is unavailable on another host (its first rank "
              "logs why)")


def _run(mpirun_job, cluster, parts, env=None):
  with cluster.small_shm("hostb", HOSTB_SHM_BYTES):
    job = mpirun_job([arg for p in parts for arg in ("--part", p)], env=env,
                     timeout=TIMEOUT)
    job.wait()
    gone = wait_hosts_empty(cluster, time.time() + GONE_SECONDS)
  assert not job.timed_out, "the job hung\n" + job.describe()
  assert gone is not None, (f"processes outlived the job by {GONE_SECONDS} "
                            "s:\n" + describe_hosts(cluster))
  return job


@pytest.mark.timeout(TIMEOUT + 60)
def test_auto_uses_mpi_on_every_host_and_says_why(mpirun_job, cluster):
  job = _run(mpirun_job, cluster, ["topology", "ops"])
  assert job.returncode == 0, job.describe()
  for rank in range(SIZE):
    ops = op_results(job, rank)
    assert ops["shm_segments"] == [], f"rank {rank}: {ops}\n" + job.describe()
    assert ops["allreduce_sum"] == [10.0, 20.0, 40.0], job.describe()
    assert ops["allreduce_big"] == [10.0, 10.0, 1 << 20], job.describe()
  assert job.output.count("CPU collectives use MPI") == 1, job.describe()
  assert ("CPU collectives use MPI: " + _ELSEWHERE) in job.rank_text(0), (
      job.describe())
  # hostb's first rank, and only it, says why.
  assert [r for r in range(SIZE) if _NOT_HERE in job.rank_text(r)] == [2], (
      job.describe())


@pytest.mark.timeout(TIMEOUT + 60)
def test_shm_fails_on_every_rank_with_the_reason(mpirun_job, cluster):
  job = _run(mpirun_job, cluster, ["topology"],
             env={"MPISTRATEGY_DATA_PLANE": "shm"})
  assert job.returncode != 0, job.describe()
  assert not job.events("INIT"), job.describe()
  cannot = "data_plane is \"shm\" but shared memory cannot carry"
  for rank in range(SIZE):
    text = job.rank_text(rank)
    assert cannot in text, f"rank {rank}\n" + job.describe()
    reason = "/dev/shm has" if rank >= 2 else _ELSEWHERE
    assert reason in text, f"rank {rank}\n" + job.describe()
