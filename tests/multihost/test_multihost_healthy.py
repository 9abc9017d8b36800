"""A healthy job on 2 simulated hosts, over TCP: 2 + 2 ranks, and 2 + 1.

One job per layout (`mh_rank.py --part topology --part ops --part keras`,
started by `mpirun -H hosta:2,hostb:N` on hosta) serves the tests, so
TensorFlow starts once per layout: topology per host, the CPU data plane,
every collective's result, and Keras `fit` ending with the same weights on
every rank.  Each test checks the exit status, the elapsed time and that no
process is left on a host.  With 2 + 1 ranks, hierarchical allreduce cannot
split a buffer into the same shards on both hosts: each host's first rank
carries the host's sum across.
"""

import json
import math

import pytest

from conftest import describe_hosts
from conftest import op_results

# The whole job, TF start-up on 4 ranks included (loaded 2 cores).
TIMEOUT = 300
# Ranks on hosta, then on hostb.
LAYOUTS = {"even": (2, 2), "uneven": (2, 1)}
_JOBS = {}


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request):
  return LAYOUTS[request.param]


def _host(layout, rank):
  return "hosta" if rank < layout[0] else "hostb"


def _job(mpirun_job, cluster, layout):
  size = sum(layout)
  if layout not in _JOBS:
    job = mpirun_job(["--part", "topology", "--part", "ops", "--part",
                      "keras"], hosts=f"hosta:{layout[0]},hostb:{layout[1]}",
                     np=size, timeout=TIMEOUT)
    job.wait()
    _JOBS[layout] = (job, None if cluster.empty() else describe_hosts(cluster))
  job, left = _JOBS[layout]
  assert not job.timed_out, "the job hung\n" + job.describe()
  assert job.returncode == 0, job.describe()
  assert job.elapsed < TIMEOUT, job.describe()
  assert left is None, "processes outlived the job:\n" + left
  assert len(job.events("DONE")) == size, job.describe()
  return job


@pytest.mark.timeout(TIMEOUT + 60)
def test_topology_per_host(mpirun_job, cluster, layout):
  job = _job(mpirun_job, cluster, layout)
  size = sum(layout)
  for rank in range(size):
    info = json.loads(job.event_text("INIT", rank))
    host = _host(layout, rank)
    on_b = host == "hostb"
    assert info == {**info, "rank": rank, "size": size,
                    "local_rank": rank - layout[0] * on_b,
                    "local_size": layout[on_b], "host": host,
                    "rank_hosts": [_host(layout, r) for r in range(size)],
                    "sum": size * (size + 1) / 2}, (
                        f"rank {rank}: {info}\n" + job.describe())
    pid, pid_host = job.event_text("PID", rank).split()
    assert pid_host == host and int(pid) == info["pid"], job.describe()


@pytest.mark.timeout(TIMEOUT + 60)
def test_cpu_allreduce_is_hierarchical(mpirun_job, cluster, layout):
  """Shared memory inside each host, MPI across (data_plane "auto")."""
  job = _job(mpirun_job, cluster, layout)
  segments = [op_results(job, rank)["shm_segments"]
              for rank in range(sum(layout))]
  # One segment per host of two ranks, shared by them; none for one rank.
  on_a, on_b = segments[:layout[0]], segments[layout[0]:]
  assert len(on_a[0]) == 1 and all(s == on_a[0] for s in on_a), segments
  if layout[1] == 1:
    assert on_b == [[]], segments
    assert ("crosses hosts from each host's first rank"
            in job.output), job.describe()
  else:
    assert len(on_b[0]) == 1 and all(s == on_b[0] for s in on_b), segments
    assert on_a[0] != on_b[0], segments
    assert "first rank" not in job.output, job.describe()
  assert "CPU collectives use MPI" not in job.output, job.describe()


@pytest.mark.timeout(TIMEOUT + 60)
def test_ops_over_tcp(mpirun_job, cluster, layout):
  job = _job(mpirun_job, cluster, layout)
  size = sum(layout)
  ranks_sum = size * (size + 1) / 2  # of rank + 1
  gathered = [[100 * r + 10 * i + j for j in range(2)]
              for r in range(size) for i in range(r + 1)]
  n = 2 * size + 1
  counts = [n // size + (1 if r < n % size else 0) for r in range(size)]
  summed = [[ranks_sum * (2 * i + j) for j in range(2)] for i in range(n)]
  for rank in range(size):
    got = op_results(job, rank)
    want = {
        "allreduce_sum": [ranks_sum, 2 * ranks_sum, 10.0 * size],
        "allreduce_avg": [ranks_sum / size, 2 * ranks_sum / size, 10.0],
        "allreduce_big": [ranks_sum, ranks_sum, 1 << 20],
        "allgather": gathered,
        "broadcast": [7.0 * (size - 1) + 1.0, 1.0 - size],
        "alltoall": [[[10 * i + rank] for i in range(size)
                      for _ in range(rank + 1)], [rank + 1] * size],
        "reducescatter": summed[sum(counts[:rank]):sum(counts[:rank + 1])],
        "allreduce_odd_mean": True,
    }
    for name, value in want.items():
      assert got.get(name) == value, (
          f"rank {rank} {name}: got {got.get(name)}, want {value}\n"
          + job.describe())


@pytest.mark.timeout(TIMEOUT + 60)
def test_keras_fit_same_weights_on_every_rank(mpirun_job, cluster, layout):
  job = _job(mpirun_job, cluster, layout)
  results = [job.event_text("WEIGHTS", r).split() for r in range(sum(layout))]
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
