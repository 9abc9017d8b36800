"""A healthy job on 2 simulated hosts x 2 ranks, over TCP.

One job (`mh_rank.py --part topology --part ops --part keras`, started by
`mpirun -H hosta:2,hostb:2 -np 4` on hosta) serves the three tests, so
TensorFlow starts once: topology per host, every collective's result, and
Keras `fit` ending with the same weights on every rank.  Each test checks
the exit status, the elapsed time and that no process is left on a host.
"""

import json
import math

import pytest

from conftest import describe_hosts

SIZE = 4
# The whole job, TF start-up on 4 ranks included (loaded 2 cores).
TIMEOUT = 300
_JOB = {}


def _job(mpirun_job, cluster):
  if "job" not in _JOB:
    job = mpirun_job(["--part", "topology", "--part", "ops", "--part",
                      "keras"], timeout=TIMEOUT)
    job.wait()
    _JOB["job"] = job
    _JOB["left"] = None if cluster.empty() else describe_hosts(cluster)
  job = _JOB["job"]
  assert not job.timed_out, "the job hung\n" + job.describe()
  assert job.returncode == 0, job.describe()
  assert job.elapsed < TIMEOUT, job.describe()
  assert _JOB["left"] is None, ("processes outlived the job:\n" +
                                _JOB["left"])
  assert len(job.events("DONE")) == SIZE, job.describe()
  return job


def _ops(job, rank):
  return {json.loads(text)[0]: json.loads(text)[1]
          for _, _, text in job.events("OP", rank)}


@pytest.mark.timeout(TIMEOUT + 60)
def test_topology_per_host(mpirun_job, cluster):
  job = _job(mpirun_job, cluster)
  for rank in range(SIZE):
    info = json.loads(job.event_text("INIT", rank))
    host = "hosta" if rank < 2 else "hostb"
    assert info == {**info, "rank": rank, "size": SIZE,
                    "local_rank": rank % 2, "local_size": 2, "host": host,
                    "sum": 10.0}, f"rank {rank}: {info}\n" + job.describe()
    pid, pid_host = job.event_text("PID", rank).split()
    assert pid_host == host and int(pid) == info["pid"], job.describe()


@pytest.mark.timeout(TIMEOUT + 60)
def test_cpu_allreduce_is_hierarchical(mpirun_job, cluster):
  """Shared memory inside each host, MPI across (data_plane "auto")."""
  job = _job(mpirun_job, cluster)
  segments = [_ops(job, rank)["shm_segments"] for rank in range(SIZE)]
  # One segment per host, shared by its two ranks.
  assert all(len(s) == 1 for s in segments), segments
  assert segments[0] == segments[1] and segments[2] == segments[3], segments
  assert segments[0] != segments[2], segments


@pytest.mark.timeout(TIMEOUT + 60)
def test_ops_over_tcp(mpirun_job, cluster):
  job = _job(mpirun_job, cluster)
  gathered = [[100 * r + 10 * i + j for j in range(2)]
              for r in range(SIZE) for i in range(r + 1)]
  n = 2 * SIZE + 1
  counts = [n // SIZE + (1 if r < n % SIZE else 0) for r in range(SIZE)]
  summed = [[10.0 * (2 * i + j) for j in range(2)] for i in range(n)]
  for rank in range(SIZE):
    got = _ops(job, rank)
    want = {
        "allreduce_sum": [10.0, 20.0, 40.0],
        "allreduce_avg": [2.5, 5.0, 10.0],
        "allreduce_big": [10.0, 10.0, 1 << 20],
        "allgather": gathered,
        "broadcast": [22.0, -3.0],
        "alltoall": [[[10 * i + rank] for i in range(SIZE)
                      for _ in range(rank + 1)], [rank + 1] * SIZE],
        "reducescatter": summed[sum(counts[:rank]):sum(counts[:rank + 1])],
        "allreduce_odd_mean": True,
    }
    for name, value in want.items():
      assert got.get(name) == value, (
          f"rank {rank} {name}: got {got.get(name)}, want {value}\n"
          + job.describe())


@pytest.mark.timeout(TIMEOUT + 60)
def test_keras_fit_same_weights_on_every_rank(mpirun_job, cluster):
  job = _job(mpirun_job, cluster)
  results = [job.event_text("WEIGHTS", r).split() for r in range(SIZE)]
  after = {r[0] for r in results}
  before = {r[1] for r in results}
  assert len(after) == 1, f"weights differ across ranks: {results}"
  assert len(before) == 1, f"initial weights differ across ranks: {results}"
  assert before != {"before=" + h for h in after}, "fit changed nothing"
  losses = [[float(v) for v in r[2].split("=", 1)[1].split(",")]
            for r in results]
  assert all(len(l) == 2 and all(math.isfinite(v) for v in l)
             for l in losses), losses
  assert losses[0][-1] < losses[0][0], f"the loss did not go down: {losses}"
